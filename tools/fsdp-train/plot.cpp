#include "plot.h"

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>

namespace fsdp_train {

namespace {

// gnuplot string literal in single quotes ('' escapes a quote).
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

std::string plot_losses(const std::vector<Curve>& curves, const std::string& png,
                        const std::string& title) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return "gnuplot not found: no " + png +
           " (install it with `apt-get install gnuplot-nox`, or run ci/install-deps.sh)";
  }
  const std::string script = png.substr(0, png.size() - (png.size() > 4 ? 4 : 0)) + ".gp";
  {
    std::ofstream gp(script);
    gp << "set terminal png size 1000,600\n"
       << "set output " << quoted(png) << "\n"
       << "set datafile separator ','\n"
       << "set title " << quoted(title) << " noenhanced\n"
       << "set xlabel 'step'\n"
       << "set ylabel 'loss (mean next-byte cross-entropy, nats)'\n"
       << "set grid\n"
       << "set key top right noenhanced\n"
       << "plot ";
    const char* styles[] = {"with lines lw 2 lc rgb '#1f77b4'",
                            "with points pt 6 ps 1.5 lw 2 lc rgb '#d62728'"};
    for (size_t i = 0; i < curves.size(); ++i) {
      gp << (i ? ", " : "") << quoted(curves[i].csv) << " using 1:2 skip 1 "
         << styles[i % 2] << " title " << quoted(curves[i].title);
    }
    gp << "\n";
    if (!gp) return "cannot write " + script + ": no " + png;
  }
  const std::string cmd = "gnuplot " + shell_quoted(script) + " 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    return fmt::format("gnuplot failed on {} (see its message above): no {}", script, png);
  }
  return "";
}

}  // namespace fsdp_train
