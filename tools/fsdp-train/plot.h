// loss.png through gnuplot (Debian: gnuplot-nox). Never fails the job: when
// gnuplot is missing or errs, the returned note says so and no PNG is made.
#pragma once

#include <string>
#include <vector>

namespace fsdp_train {

struct Curve {
  std::string csv;    // a LossLog file (step,loss,...)
  std::string title;  // legend
};

// Writes <png minus .png>.gp and runs gnuplot on it. Returns "" on success,
// else a one-line note for the user.
std::string plot_losses(const std::vector<Curve>& curves, const std::string& png,
                        const std::string& title);

}  // namespace fsdp_train
