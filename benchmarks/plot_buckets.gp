# Bucket-size sweep: torchddp's median step time relative to the best bucket size, one line per
# world size. ddp_bench runs this itself; by hand:
#   gnuplot -e "datafile='out/buckets.dat'; outfile='out/buckets.png'; worlds='1 2'" plot_buckets.gp
if (!exists("datafile")) datafile = 'buckets.dat'
if (!exists("outfile")) outfile = 'buckets.png'
if (!exists("worlds")) worlds = '1 2'
set terminal pngcairo size 800,500 noenhanced
set output outfile
set title "torchddp bucket_cap_mb sweep (first bucket 1 MiB)"
set xlabel "bucket_cap_mb (MiB, log scale)"
set ylabel "median step time / best bucket size"
set logscale x
set grid
set key top left
# buckets.dat holds one block per world size, in the order of `worlds`.
plot for [i=1:words(worlds)] datafile index (i-1) using 1:2 with linespoints lw 2 pt 7 title "world ".word(worlds, i)
