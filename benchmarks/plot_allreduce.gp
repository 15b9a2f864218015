# Allreduce time against size, the default group (shared memory on one host) and Gloo, log-log
# (bars: 25th-75th percentile). ddp_bench writes allreduce_w<world>.dat and draws it; by hand:
#   gnuplot -e "datafile='out/allreduce_w2.dat'; outfile='x.png'; plottitle='world 2'" plot_allreduce.gp
if (!exists("datafile")) datafile = 'allreduce.dat'
if (!exists("outfile")) outfile = 'allreduce.png'
if (!exists("plottitle")) plottitle = ''
set terminal pngcairo size 900,520 noenhanced
set output outfile
set title "float32 allreduce: ".plottitle
set xlabel "bytes per rank"
set ylabel "time (ms)"
set logscale xy
set format x "%.0s %cB"
set grid
set key left top
set offsets graph 0.05, graph 0.05, 0, 0
# Columns: 1 bytes, 2-4 default group (median p25 p75), 5-7 gloo.
plot datafile using 1:5:6:7 with yerrorlines lw 2 pt 7 lc rgb "#ef8a62" title "gloo (TCP loopback)", \
     '' using 1:2:3:4 with yerrorlines lw 2 pt 5 lc rgb "#2166ac" title "default group (shared memory)"
