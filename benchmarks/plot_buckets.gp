# Bucket-size sweep: median step time of torchddp relative to the best bucket size, per world size.
#   gnuplot -e "datafile='ddp_bench_out/buckets.dat'; outfile='ddp_bench_out/buckets.png'" plot_buckets.gp
if (!exists("datafile")) datafile = 'buckets.dat'
if (!exists("outfile")) outfile = 'buckets.png'
set terminal pngcairo size 800,500 noenhanced
set output outfile
set title "torchddp bucket_cap_mb sweep (first bucket 1 MiB)"
set xlabel "bucket_cap_mb (MiB, log scale)"
set ylabel "median step time / best"
set logscale x
set grid
set key top left
stats datafile nooutput
plot for [i=0:STATS_blocks-1] datafile index i using 1:2 with linespoints lw 2 pt 7 title columnheader(2)
