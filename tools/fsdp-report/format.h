// Numbers and text as the report prints them (markdown and JSON).
#pragma once

#include <nlohmann/json.hpp>

#include <limits>
#include <string>
#include <vector>

namespace report {

constexpr double kInf = std::numeric_limits<double>::infinity();

// printf with the exponent shortened: 1.000e-05 -> 1.000e-5, 1e+05 -> 1e5.
std::string fmt(const char* spec, double v);
// Tolerances in the plan's style: 1e-5, 2.5e-3.
std::string fmt_tol(double v);
// An observed error: 0, or 3 significant digits (2.500e-7).
std::string fmt_obs(double v);

// tolerance / observed; +inf when observed is 0 ("exact"); NaN when observed is not finite.
double margin_of(double tol, double observed);
// A separation check's margin: observed / threshold (> 1 passes); NaN when
// there is no threshold or observed is not finite.
double separation_margin(double threshold, double observed);
// "exact" (+inf), "n/a" (NaN), else "40x".
std::string fmt_margin(double m);
// A number for the JSON: itself when finite, else "nan", "inf" or "-inf".
nlohmann::ordered_json json_number(double v);
// A margin for the JSON: "exact" (+inf), null (NaN), else the number.
nlohmann::ordered_json json_margin(double m);

// Markdown table cell: no pipes or newlines.
std::string cell(const std::string& s);
std::string join(const std::vector<std::string>& v, const std::string& sep);

}  // namespace report
