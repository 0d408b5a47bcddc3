// lgreco-config: checks registration files and shows the effective parameters.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/params.h"
#include "config/registration.h"
#include "config/version.h"
#include "controller/settings.h"
#include "kernels/cuda_env.h"
#include "tools/cli.h"

namespace lgreco {
namespace {

const char kUsage[] = R"(usage: lgreco-config check FILE...    validate registration files
       lgreco-config show              the effective LGRECO_* parameters
       lgreco-config docs              the parameter table (Markdown, docs/CONFIG.md)
       lgreco-config params            the parameter table as JSON (for tools)
       lgreco-config version           this build's versions as JSON (for tools)

check   Validates each registration file (docs/REGISTRATION.md) as the library will
        when it loads it, and summarises it: buckets, layers, and which layers are
        compressed (1-D tensors and tensors under 1024 elements are not, unless their
        "compress" pins a codec). Errors name the file, the JSON path and the problem.
        Exit status: 0 all valid, 1 some file invalid.

show    Prints every parameter as NAME=VALUE with where the value came from
        (default, environment, or FILE:LINE of the parameter file: LGRECO_CONF_FILE,
        else ~/.lgreco.conf, else /etc/lgreco.conf), then any warning and error,
        checks the rules between parameters and the registration file named by
        LGRECO_REGISTRATION. Exit status: 0 valid, 1 invalid: a process with this
        configuration runs with compression off and says why in a WARN line.

docs    Prints the Markdown table of every parameter that docs/CONFIG.md holds.

params  Prints the same table as a JSON array of {"name", "default", "accepted",
        "meaning"} ("default" "" when unset): lgreco-run's options come from it.

version Prints a JSON object: "version", "git", "nccl_header" (the nccl.h built
        against, "" if none), "cuda_runtime" (the static CUDA runtime's version, e.g.
        13000; 0 when built without CUDA), "cuda_driver" (the CUDA version this host's
        driver supports; 0 when there is no driver) and "driver_required" (the
        minimum NVIDIA driver release for that runtime, "" when built without CUDA)
        and "variant" ("cu130" for CUDA 13.0, "cpu" without CUDA).
)";

std::string elements(uint64_t n) {
  char text[32];
  if (n >= 10'000'000) snprintf(text, sizeof text, "%.1fM", n / 1e6);
  else snprintf(text, sizeof text, "%llu", static_cast<unsigned long long>(n));
  return text;
}

// A few lines of summary per file: what is compressed, and why the rest is not.
void summarise(const config::Registration& r) {
  uint64_t total = 0, compressed = 0;
  size_t adaptive = 0, pinned = 0;
  std::map<std::string, size_t> never;  // reason -> layers
  for (const config::RegisteredBucket& bucket : r.buckets) {
    total += bucket.count;
    for (const config::RegisteredLayer& layer : bucket.layers) {
      const config::LayerPolicy policy = config::layer_policy(layer);
      if (policy.kind == config::LayerPolicy::Kind::kNever) {
        ++never[policy.reason];
        continue;
      }
      ++(policy.kind == config::LayerPolicy::Kind::kPinned ? pinned : adaptive);
      compressed += layer.numel;
    }
  }
  printf("%s: valid: model \"%s\", %zu bucket%s, %zu layers, %s elements\n", r.source.c_str(), r.model.c_str(),
         r.buckets.size(), r.buckets.size() == 1 ? "" : "s", r.layer_count(), elements(total).c_str());
  printf("  compressed: %zu layers adaptively, %zu pinned; %s elements (%.1f%%)\n", adaptive, pinned,
         elements(compressed).c_str(), total ? 100.0 * compressed / total : 0.0);
  for (const auto& [reason, n] : never) printf("  not compressed: %zu layers (%s)\n", n, reason.c_str());
}

int check(const std::vector<std::string>& files) {
  if (files.empty()) throw cli::UsageError("check needs at least one FILE");
  int status = 0;
  for (const std::string& file : files) {
    try {
      summarise(config::load_registration(file));
    } catch (const config::RegistrationError& e) {
      fprintf(stderr, "%s\n", e.what());
      status = 1;
    }
  }
  return status;
}

int show() {
  const config::Params p = config::load_params(config::ParamSources::from_process());
  printf("# parameter file: %s\n", p.conf_file.empty() ? "none" : p.conf_file.c_str());
  for (const config::Params::Entry& e : p.entries)
    printf("%s=%s  # %s\n", e.name, e.value.c_str(), e.origin.str().c_str());
  std::string candidates;
  for (const CodecSpec& c : p.candidates) candidates += (candidates.empty() ? "" : ";") + c.str();
  printf("# candidates in effect: %s\n", candidates.c_str());
  std::vector<std::string> errors = p.errors;
  if (p.valid()) {
    try {  // what the library builds from them at a communicator's start
      controller::settings_from_params(p, 0);
    } catch (const std::invalid_argument& e) {
      errors.push_back(e.what());
    }
  }
  if (!p.registration.empty()) {
    try {
      config::load_registration(p.registration);
    } catch (const config::RegistrationError& e) {
      errors.push_back(std::string("LGRECO_REGISTRATION: ") + e.what());
    }
  }
  for (const std::string& w : p.warnings) fprintf(stderr, "warning: %s\n", w.c_str());
  for (const std::string& e : errors) fprintf(stderr, "error: %s\n", e.c_str());
  if (!errors.empty()) {
    fprintf(stderr, "invalid configuration: a process with it runs with compression off\n");
    return 1;
  }
  printf("# valid; mode in effect: %s\n", config::mode_name(p.mode));
  return 0;
}

int params_json() {
  nlohmann::json table = nlohmann::json::array();
  for (const config::ParamInfo& info : config::param_table())
    table.push_back({{"name", info.name}, {"default", info.default_value}, {"accepted", info.accepted},
                     {"meaning", info.meaning}});
  printf("%s\n", table.dump(1).c_str());
  return 0;
}

// The oldest NVIDIA driver release a CUDA runtime of this major version runs on (NVIDIA's
// CUDA toolkit release notes, minor version compatibility).
const char* driver_required(int cuda_runtime) {
  if (cuda_runtime <= 0) return "";
  if (cuda_runtime >= 13000) return "580";
  if (cuda_runtime >= 12000) return "525";
  return "450";
}

int version_json() {
  const std::string full = version_string();  // "0.1.0 (git 1a2b3c4)"
  const size_t git = full.find(" (git ");
  const CudaVersions cuda = cuda_versions();
  const int nccl = nccl_header_version_code();
  std::string nccl_text;
  if (nccl > 0)
    nccl_text = std::to_string(nccl / 10000) + "." + std::to_string(nccl / 100 % 100) + "." + std::to_string(nccl % 100);
  const nlohmann::json out = {
      {"version", full.substr(0, git)},
      {"git", git == std::string::npos ? "unknown" : full.substr(git + 6, full.size() - git - 7)},
      {"nccl_header", nccl_text},
      {"cuda_runtime", cuda.built_with_cuda ? cuda.runtime : 0},
      {"cuda_driver", cuda.driver},
      {"driver_required", driver_required(cuda.built_with_cuda ? cuda.runtime : 0)},
      // The build's variant, the Python wheel's local version label: cu130 for CUDA 13.0.
      {"variant", cuda.built_with_cuda ? "cu" + std::to_string(cuda.runtime / 1000) +
                                             std::to_string(cuda.runtime % 1000 / 10)
                                       : std::string("cpu")}};
  printf("%s\n", out.dump(1).c_str());
  return 0;
}

int run(int argc, char** argv) {
  cli::Args args(argc, argv, 1);
  if (!args.next()) throw cli::UsageError("missing command (check, show, docs, params or version)");
  if (args.is_help()) {
    fputs(kUsage, stdout);
    return 0;
  }
  const std::string command = args.arg();
  std::vector<std::string> operands;
  while (args.next()) {
    if (args.is_help()) {
      fputs(kUsage, stdout);
      return 0;
    }
    if (args.arg().size() > 1 && args.arg()[0] == '-') throw cli::UsageError("unknown option " + args.arg());
    operands.push_back(args.arg());
  }
  if (command == "check") return check(operands);
  if (!operands.empty()) throw cli::UsageError(command + " takes no operands");
  if (command == "show") return show();
  if (command == "docs") {
    fputs(config::params_markdown_table().c_str(), stdout);
    return 0;
  }
  if (command == "params") return params_json();
  if (command == "version") return version_json();
  throw cli::UsageError("unknown command '" + command + "' (check, show, docs, params or version)");
}

}  // namespace
}  // namespace lgreco

int main(int argc, char** argv) {
  return lgreco::cli::guarded_main("lgreco-config", [&] { return lgreco::run(argc, argv); });
}
