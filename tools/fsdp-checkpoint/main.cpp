// fsdp-checkpoint: looks into a distributed checkpoint (fsdp/distributed_checkpoint.h)
// in one process, without mpiexec:
//
//   fsdp-checkpoint inspect <dir> [--json]
//   fsdp-checkpoint verify <dir>
//   fsdp-checkpoint export <dir> --to <file.h5|file.safetensors> [--only <prefix>]...
//                          [--include-rank-local]
//   fsdp-checkpoint diff <dirA> <dirB> [--atol X] [--rtol Y]
//
// <dir> is one checkpoint (<root>/step-<12 digits>) or a root (its newest
// complete checkpoint). docs/fsdp-checkpoint.md has examples.
#include "common.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <iostream>

namespace {

using namespace fsdp_checkpoint;

constexpr const char* kExitCodes =
    "Exit status:\n"
    "  0  done; verify: intact; diff: every tensor and value within tolerance\n"
    "  1  verify: problems found (one line each); diff: differences beyond tolerance\n"
    "  2  bad arguments, a path that is not a checkpoint (or whose index does not\n"
    "     verify: run verify), or an output that cannot be written\n"
    "  3  export/diff: a piece of a tensor failed to read (checksum, missing file)\n";

int run(int argc, char** argv) {
  CLI::App app{
      "fsdp-checkpoint: inspect, verify, export and diff libfsdp distributed checkpoints "
      "(docs/distributed_checkpoint.md). <dir> is one checkpoint (<root>/step-<12 digits>/) "
      "or a root (its newest complete checkpoint). Runs in one process: no mpiexec.",
      "fsdp-checkpoint"};
  app.footer(kExitCodes);
  app.require_subcommand(1);
  app.failure_message([](const CLI::App* a, const CLI::Error& e) -> std::string {
    return "fsdp-checkpoint: error: " + CLI::FailureMessage::simple(a, e);
  });

  std::string dir;
  bool json = false;
  auto* inspect = app.add_subcommand("inspect", "what a checkpoint holds");
  inspect->footer(
      "Prints the path, step, world size that saved it, format version, creation time, the "
      "optimizers (type, each group's options), the values (int64, double, string; rank-local "
      "ones per rank) and a table of tensors: name, kind, dtype, global shape, pieces, bytes, "
      "with totals.");
  inspect->add_option("dir", dir, "checkpoint or root")->required();
  inspect->add_flag("--json", json, "print the same as one JSON object");

  auto* verify = app.add_subcommand("verify", "read and check every piece of every tensor");
  verify->footer(
      "Runs every check a load runs: the index (checksum, rank file names inside the "
      "checkpoint, pieces inside their tensors and tiling them, sizes within the files), each "
      "rank file (a regular file inside the directory, of the size written), every piece read "
      "block by block (HDF5 Fletcher-32 checksums; stored as written, of the index's dtype), "
      "and no NaN or infinity in parameters and optimizer state. Prints 'OK <path>: N tensors, "
      "B bytes verified' (exit 0), or one line per problem, each saying what a load does about "
      "it, and 'FAILED <path>: K problems' (exit 1). Not a checkpoint: exit 2.");
  verify->add_option("dir", dir, "checkpoint or root")->required();

  ExportArgs ex;
  auto* exp = app.add_subcommand("export", "write the full tensors to one .h5 or .safetensors file");
  exp->footer(
      "Reads one tensor (at most 64 MiB of rows) at a time. .h5/.hdf5: one dataset per tensor "
      "at its name ('/' makes groups; 0-d tensors are scalar datasets; bfloat16 and float16 "
      "are written as float32, bool as uint8), root attributes 'step' and 'source'. "
      ".safetensors: the safetensors format (F32 F64 F16 BF16 I64 I32 I16 I8 U8 BOOL, exact "
      "bits), __metadata__ {\"step\", \"source\"}. Rank-local tensors (__rank<R>/...) are "
      "skipped unless --include-rank-local. The file is written as <file>.partial and renamed "
      "when complete.");
  exp->add_option("dir", ex.dir, "checkpoint or root")->required();
  exp->add_option("--to", ex.to, "output file: <name>.h5, <name>.hdf5 or <name>.safetensors "
                                 "(replaced if it exists)")
      ->required();
  exp->add_option("--only", ex.only,
                  "export only the tensors whose names start with this text (plain prefix: "
                  "'model/fc1' takes model/fc1.weight and model/fc1.bias); repeatable");
  exp->add_flag("--include-rank-local", ex.include_rank_local,
                "also export the rank-local tensors (__rank<R>/...), skipped by default");

  DiffArgs df;
  auto* diff = app.add_subcommand("diff", "compare two checkpoints tensor by tensor");
  diff->footer(
      "Compares tensors by name (one at a time) and the values: names only in one, shape or "
      "dtype differences, and the max |a - b| of each common tensor. An element is within "
      "tolerance where |a - b| <= atol + rtol |b| (NaN equal to NaN); default atol 0, rtol 0: "
      "bitwise. One line per differing tensor or value, then a summary: SAME (exit 0) or "
      "DIFFERENT (exit 1).");
  diff->add_option("dirA", df.a, "checkpoint or root")->required();
  diff->add_option("dirB", df.b, "checkpoint or root")->required();
  const CLI::Validator tolerance(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0' || !std::isfinite(v) || v < 0) {
          return text + ": must be a finite number >= 0";
        }
        return "";
      },
      "TOL >= 0");
  diff->add_option("--atol", df.atol, "absolute tolerance (>= 0)")
      ->capture_default_str()
      ->check(tolerance);
  diff->add_option("--rtol", df.rtol, "relative tolerance (>= 0)")
      ->capture_default_str()
      ->check(tolerance);

  for (CLI::App* sub : {inspect, verify, exp, diff}) {
    sub->footer(sub->get_footer() + "\n\n" + kExitCodes);
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;  // --help: 0; CLI11's own codes -> 2
  }

  try {
    if (*inspect) return run_inspect(dir, json);
    if (*verify) return run_verify(dir);
    if (*exp) return run_export(ex);
    return run_diff(df);
  } catch (const UsageError& e) {
    std::cerr << "fsdp-checkpoint: error: " << e.what() << "\n";
    return kExitUsage;
  } catch (const DamagedError& e) {
    std::cerr << "fsdp-checkpoint: error: " << e.what() << "\n";
    return kExitDamaged;
  } catch (const fsdp::dcp::CheckpointError& e) {
    std::cerr << "fsdp-checkpoint: error: " << fsdp::dcp::to_string(e.kind()) << ": " << e.what()
              << "\n";
    return kExitDamaged;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-checkpoint: error: " << e.what() << "\n";
    return kExitUsage;
  }
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
