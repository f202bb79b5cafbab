// Numbers and text as the report prints them (format.h).
#include "format.h"

#include <cmath>
#include <cstdio>

namespace report {

std::string fmt(const char* spec, double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, spec, v);
  std::string s = buf;
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  std::string sign;
  if (!exp.empty() && (exp[0] == '+' || exp[0] == '-')) {
    if (exp[0] == '-') sign = "-";
    exp = exp.substr(1);
  }
  while (exp.size() > 1 && exp[0] == '0') exp = exp.substr(1);
  return mant + "e" + sign + exp;
}
std::string fmt_tol(double v) {
  if (v == 0 || !std::isfinite(v)) return fmt("%g", v);
  std::string s = fmt("%.2e", v);
  const auto e = s.find('e');
  std::string mant = s.substr(0, e);
  while (mant.find('.') != std::string::npos && (mant.back() == '0' || mant.back() == '.')) {
    mant.pop_back();
  }
  return mant + s.substr(e);
}
std::string fmt_obs(double v) { return v == 0 ? "0" : fmt("%.3e", v); }

double margin_of(double tol, double observed) {
  if (!std::isfinite(observed)) return std::numeric_limits<double>::quiet_NaN();
  if (observed <= 0) return kInf;
  return tol / observed;
}
double separation_margin(double threshold, double observed) {
  return threshold > 0 && std::isfinite(observed) ? observed / threshold
                                                  : std::numeric_limits<double>::quiet_NaN();
}
std::string fmt_margin(double m) {
  if (std::isnan(m)) return "n/a";
  if (std::isinf(m)) return "exact";
  return fmt("%.3g", m) + "x";
}
nlohmann::ordered_json json_number(double v) {
  if (std::isfinite(v)) return v;
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}
nlohmann::ordered_json json_margin(double m) {
  if (std::isinf(m)) return "exact";
  if (std::isnan(m)) return nullptr;
  return m;
}

std::string cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

}  // namespace report
