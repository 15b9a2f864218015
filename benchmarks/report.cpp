#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "stats.h"

namespace bench {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Per round, the median step of `a` over the median step of `b` in the same round, then the median
// over rounds: a slow patch of the machine slows both sides of each ratio.
double ratio(const json& a, const json& b) {
  const auto ra = a["round_median_ms"].get<std::vector<double>>();
  const auto rb = b["round_median_ms"].get<std::vector<double>>();
  std::vector<double> ratios;
  for (size_t r = 0; r < ra.size() && r < rb.size(); ++r) ratios.push_back(ra[r] / rb[r]);
  return median(ratios);
}

// The share of the naive variant's communication time that a bucketed engine hides, from ratios
// against local: naive costs N x local (N - 1 of it communication, done after backward); the
// engine costs E x local; (N - E) / (N - 1) is 1 when all of it is hidden, 0 when none is. Clamped
// to [0, 1] (noise, or fewer collectives than naive, can push it out); NaN when naive is within 5%
// of local, i.e. there is no communication to hide.
double overlap(double naive_over_local, double engine_over_local) {
  if (!(naive_over_local - 1 > 0.05)) return std::nan("");
  return std::clamp((naive_over_local - engine_over_local) / (naive_over_local - 1), 0.0, 1.0);
}

std::string fixed(double value, int digits = 3) {
  if (!std::isfinite(value)) return "n/a";
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(digits);
  out << value;
  return out.str();
}

json number_or_null(double value) { return std::isfinite(value) ? json(value) : json(); }

std::string cap_label(double cap) { return cap == 0 ? "0 (per param)" : fixed(cap, cap == std::floor(cap) ? 0 : 2); }

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// One (model, world) timing job: a row per variant with its statistics and ratios.
json analyse(const json& raw, const std::map<std::string, json>& memory) {
  std::map<std::string, json> by_id;
  for (const auto& v : raw["variants"]) by_id[v["id"].get<std::string>()] = v;
  // local and naive are absent when --only left them out: their ratios are then n/a.
  const json none = {{"round_median_ms", std::vector<double>{}}};
  const json& local = by_id.count("local") ? by_id.at("local") : none;
  // In a world of one there is no communication to hide.
  const double naive_over_local =
      raw["world"] == 1 || !by_id.count("naive") ? std::nan("") : ratio(by_id.at("naive"), local);
  json rows = json::array();
  for (const auto& v : raw["variants"]) {
    const auto times = v["times_ms"].get<std::vector<double>>();
    const std::string id = v["id"];
    const std::string kind = v["kind"];
    json row = {{"model", raw["model"]}, {"batch", raw["batch"]}, {"world", raw["world"]}, {"variant", kind},
                {"bucket_cap_mb", v["bucket_cap_mb"]}, {"collectives", v["collectives"]},
                {"median_ms", number_or_null(median(times))}, {"p25_ms", number_or_null(quantile(times, 0.25))},
                {"p75_ms", number_or_null(quantile(times, 0.75))}, {"steps", times.size()}};
    const double vs_local = ratio(v, local);
    row["ratio_vs_local"] = number_or_null(vs_local);
    if (!v["bucket_cap_mb"].is_null()) {
      std::ostringstream reducer_id;
      reducer_id << "reducer@" << v["bucket_cap_mb"].get<double>();
      const auto reducer = by_id.find(reducer_id.str());
      if (kind != "reducer" && reducer != by_id.end()) row["ratio_vs_reducer"] = ratio(v, reducer->second);
      row["overlap_efficiency"] = number_or_null(overlap(naive_over_local, vs_local));
    }
    // The features' costs: against ours at the same cap; ours_auto against the fastest fixed cap.
    if (kind == "ours_join" || kind == "ours_detail" || kind == "ours_syncbn" || kind == "ours_optimizer") {
      std::ostringstream ours_id;
      ours_id << "ours@" << v["bucket_cap_mb"].get<double>();
      const auto ours = by_id.find(ours_id.str());
      if (ours != by_id.end()) row["ratio_vs_ours"] = ratio(v, ours->second);
    }
    // ZeRO's cost per step: against plain Adam through DDP at the same cap.
    if (kind.rfind("ours+zero_adam", 0) == 0) {
      std::ostringstream adam_id;
      adam_id << "ours+adam@" << v["bucket_cap_mb"].get<double>();
      const auto adam = by_id.find(adam_id.str());
      if (adam != by_id.end()) row["ratio_vs_adam"] = ratio(v, adam->second);
    }
    // Fully sharded data parallel: against plain Adam through DDP (its one cap).
    if (kind.rfind("fsdp_adam", 0) == 0) {
      for (const auto& other : raw["variants"]) {
        if (other["kind"] == "ours+adam") row["ratio_vs_adam"] = ratio(v, other);
      }
    }
    // The hooks: also against c10d's own fp16 hook at the same cap.
    if (kind.rfind("ours+", 0) == 0) {
      std::ostringstream peer_id;
      peer_id << "reducer+fp16@" << v["bucket_cap_mb"].get<double>();
      const auto peer = by_id.find(peer_id.str());
      if (peer != by_id.end()) row["ratio_vs_reducer_fp16"] = ratio(v, peer->second);
    }
    if (kind == "ours_auto") {
      const json* best = nullptr;
      for (const auto& other : raw["variants"]) {
        if (other["kind"] != "ours") continue;
        if (!best || median(other["times_ms"].get<std::vector<double>>()) <
                         median((*best)["times_ms"].get<std::vector<double>>())) {
          best = &other;
        }
      }
      if (best) {
        row["best_fixed_cap_mb"] = (*best)["bucket_cap_mb"];
        row["ratio_vs_best_fixed"] = ratio(v, *best);
      }
    }
    row["note"] = v.value("note", "");
    const auto mem = memory.find(id);
    if (mem != memory.end()) {
      row["peak_rss_steady_mib"] = mem->second["steady_peak_delta_mib"];
      row["peak_rss_setup_mib"] = mem->second["setup_peak_delta_mib"];
      if (mem->second.contains("steady_pss_delta_mib")) row["pss_steady_mib"] = mem->second["steady_pss_delta_mib"];
      if (mem->second.contains("optimizer_state_bytes_per_rank")) {
        row["optimizer_state_bytes_per_rank"] = mem->second["optimizer_state_bytes_per_rank"];
      }
      if (mem->second.contains("largest_parameter_bytes")) {
        row["largest_parameter_bytes"] = mem->second["largest_parameter_bytes"];
      }
      for (const char* field : {"library_bytes", "largest_block_bytes", "parameters", "padded_parameters", "baseline_rss_mib"}) {
        if (mem->second.contains(field)) row[field] = mem->second[field];
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// How the bench's two fully_shard variants are set (variants.h).
const char* fsdp_settings(const std::string& variant) {
  return variant == "fsdp_adam" ? "no prefetch: forward_prefetch(false), BackwardPrefetch::kNone"
                                : "FSDP2's prefetching, fully_shard's defaults";
}

const json* find_row(const json& rows, const std::string& variant, double cap = -1) {
  for (const auto& row : rows) {
    if (row["variant"] != variant) continue;
    if (cap < 0 || (!row["bucket_cap_mb"].is_null() && row["bucket_cap_mb"].get<double>() == cap)) return &row;
  }
  return nullptr;
}

double get(const json* row, const char* field) {
  return row && row->contains(field) && !(*row)[field].is_null() ? (*row)[field].get<double>() : std::nan("");
}

void print_summary(const json& raw, const json& rows, const Options& o) {
  const double gradient_mb = raw["parameters"].get<double>() * 4 / 1e6;
  std::printf("\n== %s, world %d: %s parameters (%.1f MB of fp32 gradients), batch %d per rank; "
              "%d rounds x %d steps ==\n",
              raw["label"].get<std::string>().c_str(), raw["world"].get<int>(),
              std::to_string(raw["parameters"].get<int64_t>()).c_str(), gradient_mb, raw["batch"].get<int>(),
              raw["rounds"].get<int>(), raw["steps"].get<int>());
  std::printf("  %-12s %9s %9s %9s %11s %12s\n", "variant", "median", "p25", "p75", "collectives", "x/local");
  for (const char* name : {"local", "naive", "naive_flat", "naive_check"}) {
    const json* row = find_row(rows, name);
    if (!row) continue;
    std::printf("  %-12s %9.2f %9.2f %9.2f %11lld %12s\n", name, get(row, "median_ms"), get(row, "p25_ms"),
                get(row, "p75_ms"), static_cast<long long>((*row)["collectives"].get<int64_t>()),
                fixed(get(row, "ratio_vs_local")).c_str());
  }
  std::printf("  %-14s %10s %10s %9s %13s %11s %14s %22s\n", "bucket MiB", "reducer ms", "ours ms",
              "buckets", "ours/reducer", "ours/local", "reducer/local", "overlap ours/reducer");
  for (double cap : o.caps) {
    const json* reducer = find_row(rows, "reducer", cap);
    const json* ours = find_row(rows, "ours", cap);
    if (!reducer || !ours) continue;  // left out by --only
    const std::string buckets = std::to_string((*reducer)["collectives"].get<int64_t>()) + "/" +
                                std::to_string((*ours)["collectives"].get<int64_t>());
    const std::string overlaps = fixed(get(ours, "overlap_efficiency"), 2) + " / " +
                                 fixed(get(reducer, "overlap_efficiency"), 2);
    std::printf("  %-14s %10.2f %10.2f %9s %13s %11s %14s %22s\n", cap_label(cap).c_str(),
                get(reducer, "median_ms"), get(ours, "median_ms"), buckets.c_str(),
                fixed(get(ours, "ratio_vs_reducer")).c_str(), fixed(get(ours, "ratio_vs_local")).c_str(),
                fixed(get(reducer, "ratio_vs_local")).c_str(), overlaps.c_str());
  }
  for (double cap : o.view_caps) {
    const json* view = find_row(rows, "ours_view", cap);
    if (!view) continue;
    std::printf("  ours_view @%s MiB (gradient_as_bucket_view): %.2f ms, ours_view/reducer %s, ours_view/local %s\n",
                cap_label(cap).c_str(), get(view, "median_ms"), fixed(get(view, "ratio_vs_reducer")).c_str(),
                fixed(get(view, "ratio_vs_local")).c_str());
  }
  if (const json* row = find_row(rows, "ours_gloo")) {
    std::printf("  ours_gloo @%s MiB (shared memory off, Gloo alone): %.2f ms, ours_gloo/reducer %s, ours/ours_gloo %s\n",
                cap_label((*row)["bucket_cap_mb"].get<double>()).c_str(), get(row, "median_ms"),
                fixed(get(row, "ratio_vs_reducer")).c_str(),
                fixed(get(find_row(rows, "ours", (*row)["bucket_cap_mb"].get<double>()), "median_ms") /
                      get(row, "median_ms")).c_str());
  }
  const std::pair<const char*, const char*> features[] = {
      {"ours_join", "inside ddp::Join, even inputs"},
      {"ours_detail", "TORCH_DISTRIBUTED_DEBUG=DETAIL"},
      {"ours_syncbn", "every BatchNorm a ddp::SyncBatchNorm"},
      {"ours_optimizer", "no wrapper: ddp::DistributedOptimizer<SGD>"}};
  for (const auto& [name, what] : features) {
    const json* row = find_row(rows, name);
    if (!row) continue;
    std::printf("  %s @%s MiB (%s): %.2f ms, %s/ours %s\n", name,
                cap_label((*row)["bucket_cap_mb"].get<double>()).c_str(), what, get(row, "median_ms"), name,
                fixed(get(row, "ratio_vs_ours")).c_str());
  }
  // ZeRO+Adam step / DDP+Adam step (the targets: <= 1.05 without overlap, <= 0.95 with).
  for (const char* name : {"ours+zero_adam", "ours+zero_adam_overlap"}) {
    const json* row = find_row(rows, name);
    if (!row) continue;
    std::printf("  %s @%s MiB: %.2f ms, %s/ours+adam %s\n", name, cap_label((*row)["bucket_cap_mb"].get<double>()).c_str(),
                get(row, "median_ms"), name, fixed(get(row, "ratio_vs_adam")).c_str());
  }
  for (const char* name : {"fsdp_adam", "fsdp_adam+prefetch"}) {
    const json* row = find_row(rows, name);
    if (!row) continue;
    std::printf("  %s (ddp::fully_shard, every block, %s): %.2f ms, %s/ours+adam %s\n", name, fsdp_settings(name),
                get(row, "median_ms"), name, fixed(get(row, "ratio_vs_adam")).c_str());
  }
  if (const json* row = find_row(rows, "ours_auto")) {
    std::printf("  ours_auto (bucket_cap_mb_auto, %s MiB): %.2f ms, ours_auto/ours@%s (the fastest fixed cap) %s\n",
                (*row)["note"].get<std::string>().c_str(), get(row, "median_ms"),
                std::isnan(get(row, "best_fixed_cap_mb")) ? "?" : cap_label(get(row, "best_fixed_cap_mb")).c_str(),
                fixed(get(row, "ratio_vs_best_fixed")).c_str());
  }
  // Communication hooks: x/reducer is against the reducer in fp32 at the same cap.
  bool hook_header = false;
  for (const char* name : {"reducer+fp16", "ours+fp16", "ours+bf16", "ours+powersgd1", "ours+powersgd4"}) {
    const json* row = find_row(rows, name);
    if (!row) continue;
    if (!hook_header) {
      std::printf("  %-16s %9s %11s %17s %9s   (comm hooks @%s MiB)\n", "hook", "ms", "x/reducer", "x/reducer+fp16",
                  "x/local", cap_label((*row)["bucket_cap_mb"].get<double>()).c_str());
      hook_header = true;
    }
    std::printf("  %-16s %9.2f %11s %17s %9s\n", name, get(row, "median_ms"), fixed(get(row, "ratio_vs_reducer")).c_str(),
                fixed(get(row, "ratio_vs_reducer_fp16")).c_str(), fixed(get(row, "ratio_vs_local")).c_str());
  }
}

// Adam's state per rank, whole or sharded by ZeRO (the memory pass measures it at every world
// size); for ZeRO, beside the bound it promises: Adam's whole state (what ours+adam holds on every
// rank) / W plus the state of the largest parameter (two moments).
void print_optimizer_state(const json& rows, int world) {
  const json* whole = find_row(rows, "ours+adam");
  for (const auto& row : rows) {
    if (!row.contains("optimizer_state_bytes_per_rank")) continue;
    const std::string name = row["variant"];
    if (name != "ours+adam" && name.rfind("ours+zero_adam", 0) != 0) continue;  // the SGD variants hold none
    std::printf("    %-22s optimizer state per rank at world %d (MiB):", name.c_str(), world);
    double most = 0;
    for (const auto& bytes : row["optimizer_state_bytes_per_rank"]) {
      std::printf(" %.2f", bytes.get<double>() / (1 << 20));
      most = std::max(most, bytes.get<double>());
    }
    if (name != "ours+adam" && whole != nullptr && whole->contains("optimizer_state_bytes_per_rank") &&
        row.contains("largest_parameter_bytes")) {
      const double bound = (*whole)["optimizer_state_bytes_per_rank"][0].get<double>() / world +
                           2 * row["largest_parameter_bytes"].get<double>();
      std::printf("  (bound 1/W + largest parameter: %.2f, %s)", bound / (1 << 20), most <= bound ? "within" : "EXCEEDED");
    }
    std::printf("\n");
  }
}

// fully_shard's memory at this world: the library's count of parameter, gradient and Adam state
// bytes per rank against its promise (16/W bytes per parameter, plus one block's full parameters
// and gradients), and the peak RSS of a rank against DDP+Adam's. A parameter whose rows W does not
// divide is padded to W chunks of whole rows: the bound counts the parameters as padded.
void print_fsdp_memory(const json& rows, int world, const char* variant) {
  const json* fsdp = find_row(rows, variant);
  const json* adam = find_row(rows, "ours+adam");
  if (!fsdp || !fsdp->contains("library_bytes")) return;
  const json& bytes = (*fsdp)["library_bytes"];
  const double params = (*fsdp)["parameters"].get<double>();
  const double padded = fsdp->contains("padded_parameters") ? (*fsdp)["padded_parameters"].get<double>() : params;
  const double held = bytes["parameter_bytes"].get<double>() + bytes["gradient_bytes"].get<double>() +
                      (*fsdp)["optimizer_state_bytes_per_rank"][0].get<double>();
  const double bound = 16.0 / world * padded + 2 * (*fsdp)["largest_block_bytes"].get<double>();
  const double peak = held + bytes["peak_unsharded_bytes"].get<double>();
  std::printf("    %s (%s) at world %d: shards + their gradients + Adam state %.1f MiB per rank (%.2f bytes/parameter; "
              "16/W = %.2f); bound 16/W (of %.0f parameters padded to W chunks, %.0f more than the model's) + one "
              "block's full parameters and gradients %.1f MiB: %s between steps; with the most ever unsharded at once "
              "(full parameters, gradients, reduction buffers, prefetched blocks) %.1f MiB: %s\n",
              variant, fsdp_settings(variant), world, held / (1 << 20), held / params, 16.0 / world, padded, padded - params, bound / (1 << 20),
              held <= bound ? "within" : "EXCEEDED", peak / (1 << 20), peak <= bound ? "within" : "EXCEEDED");
  if (adam && adam->contains("baseline_rss_mib") && fsdp->contains("baseline_rss_mib")) {
    const double mine = get(fsdp, "baseline_rss_mib") + get(fsdp, "peak_rss_steady_mib");
    const double theirs = get(adam, "baseline_rss_mib") + get(adam, "peak_rss_steady_mib");
    std::printf("    peak RSS per rank while training (the whole process): %s %.0f MiB, ours+adam %.0f MiB, "
                "%s/ours+adam %.2f\n", variant, mine, theirs, variant, mine / theirs);
  }
}

// Memory above local is what synchronization holds: buckets, plus gradients outside them.
void print_memory(const json& rows, int world, double gradient_mib) {
  std::printf("  peak RSS above model+data (MiB), each variant alone in fresh ranks at world %d; fp32 gradients: "
              "%.1f MiB\n", world, gradient_mib);
  std::printf("    %-16s %8s %22s %8s %22s %22s\n", "variant", "steady", "steady-local (x grads)", "setup",
              "setup-local (x grads)", "PSS steady-local");
  const json* local = find_row(rows, "local");
  for (const auto& row : rows) {
    if (!row.contains("peak_rss_steady_mib")) continue;
    std::string name = row["variant"];
    if (!row["bucket_cap_mb"].is_null()) name += " @" + cap_label(row["bucket_cap_mb"].get<double>());
    const double steady = get(&row, "peak_rss_steady_mib");
    const double setup = get(&row, "peak_rss_setup_mib");
    const double steady_extra = steady - get(local, "peak_rss_steady_mib");
    const double setup_extra = setup - get(local, "peak_rss_setup_mib");
    const double pss_extra = get(&row, "pss_steady_mib") - get(local, "pss_steady_mib");
    std::printf("    %-16s %8.1f %13.1f (%5.2f x) %8.1f %13.1f (%5.2f x) %13.1f (%5.2f x)\n", name.c_str(), steady,
                steady_extra, steady_extra / gradient_mib, setup, setup_extra, setup_extra / gradient_mib, pss_extra,
                pss_extra / gradient_mib);
  }
  std::printf("    steady: peak while training after warm-up; setup: peak during construction and the first\n"
              "    steps (includes the one bucket rebuild); both resident set (RSS), which counts the pages of\n"
              "    shared memory a rank touches in its peers' buckets as its own too. PSS steady-local: the\n"
              "    proportional set after the steady steps (shared pages divided among the ranks that map\n"
              "    them), what this rank really adds; not a peak\n");
}

// Columns: index, bucket label, then median/p25/p75 for local, naive, reducer, ours, ours_view,
// reducer+fp16, ours+fp16, ours+bf16, ours+powersgd1, ours+powersgd4.
void write_plot_data(const fs::path& file, const json& rows, const Options& o) {
  std::ofstream dat(file);
  dat << "# index cap local(med p25 p75) naive(...) reducer(...) ours(...) ours_view(...) reducer+fp16(...) "
         "ours+fp16(...) ours+bf16(...) ours+powersgd1(...) ours+powersgd4(...); ? = not run\n";
  for (size_t i = 0; i < o.caps.size(); ++i) {
    const double cap = o.caps[i];
    dat << i << " \"" << (cap == 0 ? std::string("0 (per param)") : cap_label(cap)) << "\"";
    for (const json* row : {find_row(rows, "local"), find_row(rows, "naive"), find_row(rows, "reducer", cap),
                            find_row(rows, "ours", cap), find_row(rows, "ours_view", cap),
                            find_row(rows, "reducer+fp16", cap), find_row(rows, "ours+fp16", cap),
                            find_row(rows, "ours+bf16", cap), find_row(rows, "ours+powersgd1", cap),
                            find_row(rows, "ours+powersgd4", cap)}) {
      for (const char* field : {"median_ms", "p25_ms", "p75_ms"}) {
        const double value = get(row, field);
        dat << ' ' << (std::isfinite(value) ? fixed(value, 3) : "?");
      }
    }
    dat << '\n';
  }
}

}  // namespace

bool plot(const std::string& script, const std::string& dat, const std::string& png, const std::string& title) {
  const fs::path path = fs::path(DDP_BENCH_SOURCE_DIR) / script;
  const std::string command = "gnuplot -e \"datafile='" + dat + "'; outfile='" + png + "'; plottitle='" + title +
                              "'\" '" + path.string() + "'";
  return std::system(command.c_str()) == 0 && fs::exists(png);
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

bool write_report(const Options& o, const std::string& load_at_start) {
  const fs::path dir(o.out);
  bool ok = true;
  json all = {{"date", utc_now()},
              {"machine", {{"cpu", cpu_model()}, {"cores", std::thread::hardware_concurrency()}}},
              {"load_average", {{"start", load_at_start}, {"end", load_average()}}},
              {"options", {{"worlds", o.worlds}, {"caps", o.caps}, {"view_caps", o.view_caps}, {"warmup", o.warmup},
                           {"steps", o.steps}, {"rounds", o.rounds}, {"memory_steps", o.memory_steps},
                           {"torch_threads_per_rank", 1}}},
              {"rows", json::array()}};
  std::ofstream csv(dir / "results.csv");
  csv << "model,batch,world,variant,bucket_cap_mb,collectives,median_ms,p25_ms,p75_ms,steps,ratio_vs_local,"
         "ratio_vs_reducer,overlap_efficiency,peak_rss_steady_mib,peak_rss_setup_mib,ratio_vs_reducer_fp16\n";
  std::printf("ours/reducer and ours/local: per round, median step of one over the other; median over rounds.\n"
              "overlap = (naive - ours) / (naive - local), from those ratios: the share of the naive variant's\n"
              "communication time that ours (or the reducer) hides; 1 = all, 0 = none, clamped; n/a without\n"
              "communication to hide (world 1).\n");
  const int memory_world = *std::max_element(o.worlds.begin(), o.worlds.end());
  std::vector<std::string> images;
  for (const auto& config : o.configs) {
    for (int world : o.worlds) {
      std::ifstream in(dir / timing_file(config, world));
      if (!in) {
        std::cerr << "missing " << timing_file(config, world) << "\n";
        ok = false;
        continue;
      }
      const json raw = json::parse(in);
      std::map<std::string, json> memory;
      if (o.memory) {
        // With features: the Adam variants have memory rows too, at every world.
        for (const auto& spec : all_variants(o.caps, o.view_caps, /*features=*/true, /*hooks=*/false)) {
          std::ifstream mem(dir / memory_file(config, world, spec));
          if (mem) memory[spec.id()] = json::parse(mem);
        }
      }
      const json rows = analyse(raw, memory);
      for (const auto& row : rows) {
        const double med = get(&row, "median_ms");
        if (!(std::isfinite(med) && med > 0)) {
          std::cerr << "no positive finite median for " << row["variant"] << " in " << config.label() << "\n";
          ok = false;
        }
        auto cell = [&](const char* field, int digits) {
          return row.contains(field) && !row[field].is_null() ? fixed(row[field].get<double>(), digits) : "";
        };
        csv << row["model"].get<std::string>() << ',' << row["batch"] << ',' << row["world"] << ','
            << row["variant"].get<std::string>() << ',' << cell("bucket_cap_mb", 2) << ',' << row["collectives"]
            << ',' << cell("median_ms", 3) << ',' << cell("p25_ms", 3) << ',' << cell("p75_ms", 3) << ','
            << row["steps"] << ',' << cell("ratio_vs_local", 3) << ',' << cell("ratio_vs_reducer", 3) << ','
            << cell("overlap_efficiency", 3) << ',' << cell("peak_rss_steady_mib", 1) << ','
            << cell("peak_rss_setup_mib", 1) << ',' << cell("ratio_vs_reducer_fp16", 3) << '\n';
        all["rows"].push_back(row);
      }
      print_summary(raw, rows, o);
      if (o.memory && world == memory_world) {
        if (o.only.empty() && memory.size() < 2 + 3 * o.view_caps.size()) {
          std::cerr << "memory results missing for " << config.label() << "\n";
          ok = false;
        }
        print_memory(rows, world, raw["parameters"].get<double>() * 4 / (1 << 20));
      }
      if (o.memory) print_optimizer_state(rows, world);
      if (o.memory) {
        for (const char* variant : {"fsdp_adam", "fsdp_adam+prefetch"}) print_fsdp_memory(rows, world, variant);
      }
      const std::string stem = "steps_" + config.label() + "_w" + std::to_string(world);
      write_plot_data(dir / (stem + ".dat"), rows, o);
      const std::string title = config.label() + ", world " + std::to_string(world);
      if (plot("plot_steps.gp", (dir / (stem + ".dat")).string(), (dir / (stem + ".png")).string(), title)) {
        images.push_back(stem + ".png");
      } else {
        std::cerr << "gnuplot failed for " << stem << ".dat\n";
        ok = false;
      }
    }
  }
  all["load_average"]["end"] = load_average();
  std::ofstream(dir / "results.json") << all.dump(2) << "\n";
  std::printf("\nload average (1, 5, 15 min): %s at start, %s at end\n", load_at_start.c_str(),
              load_average().c_str());
  std::printf("wrote %s, results.json", (dir / "results.csv").string().c_str());
  for (const auto& image : images) std::printf(", %s", image.c_str());
  std::printf("\n");
  std::fflush(stdout);
  return ok;
}

}  // namespace bench
