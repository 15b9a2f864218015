#include "multiprocess.h"
int main(int argc, char** argv) { return ddp::test::main_with_workers(argc, argv); }
