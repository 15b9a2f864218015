// The program progress_test.sh starts under ddprun: a progress line redrawn with "\r", as a
// training loop prints one, and nothing of the library (torch-free, so it builds in seconds).
// Usage: progress_child [REDRAWS [INTERVAL_MS]]   (defaults: 5 redraws, 300 ms apart)
//
// Each redraw is "\rstep K/N rank=R" (R from RANK), the odd ones through std::cout and the even
// ones through printf, and none is flushed: whether it reaches ddprun before the next one is up
// to how the rank's stdout is buffered. A final "\n" ends the line, then "done rank=R".
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

int main(int argc, char** argv) {
  const int redraws = argc > 1 ? std::atoi(argv[1]) : 5;
  const int interval_ms = argc > 2 ? std::atoi(argv[2]) : 300;
  const char* rank_env = std::getenv("RANK");
  const int rank = rank_env ? std::atoi(rank_env) : 0;
  for (int step = 1; step <= redraws; ++step) {
    if (step % 2 == 1) {
      std::cout << "\rstep " << step << "/" << redraws << " rank=" << rank;
    } else {
      std::printf("\rstep %d/%d rank=%d", step, redraws, rank);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
  }
  std::printf("\ndone rank=%d\n", rank);
  return 0;
}
