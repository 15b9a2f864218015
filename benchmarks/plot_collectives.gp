# torch.distributed's other collectives: the default group's time (shared memory on one host) over
# Gloo's alone, against size, one line per collective, log-log. ddp_bench writes
# collectives_w<world>.dat (a block per collective: its name, then bytes, default ms, gloo ms) and
# draws it; by hand:
#   gnuplot -e "datafile='out/collectives_w2.dat'; outfile='x.png'; plottitle='world 2'" plot_collectives.gp
if (!exists("datafile")) datafile = 'collectives.dat'
if (!exists("outfile")) outfile = 'collectives.png'
if (!exists("plottitle")) plottitle = ''
set terminal pngcairo size 900,520 noenhanced
set output outfile
set title "float32 collectives, default group / gloo alone: ".plottitle
set xlabel "bytes per rank"
set ylabel "time / gloo's time (lower is faster)"
set logscale xy
set format x "%.0s %cB"
set grid
set key outside right
stats datafile every ::1 nooutput
plot for [i=0:STATS_blocks-1] datafile index i using 1:($2/$3) with linespoints lw 2 pt 7 title columnheader(1), \
     1 with lines dt 2 lc rgb "black" title "gloo"
