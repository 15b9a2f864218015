#pragma once
// Merges what rank 0 of each job wrote into results.csv, results.json, a summary on stdout and one
// PNG per (model, world) of step time against bucket size. Returns false when a variant produced
// no usable time or a memory job no number (the quick test relies on that).
#include <string>

#include "options.h"

namespace bench {

bool write_report(const Options& options, const std::string& load_at_start);
// Draws `dat` into `png` with the gnuplot script benchmarks/<script>; false if gnuplot failed.
bool plot(const std::string& script, const std::string& dat, const std::string& png, const std::string& title);
std::string load_average();  // /proc/loadavg's first three fields

}  // namespace bench
