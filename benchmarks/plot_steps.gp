# Median step time (bars: 25th-75th percentile) against bucket_cap_mb for one model and world
# size. ddp_bench runs this for every steps_<model>_w<world>.dat it writes; by hand:
#   gnuplot -e "datafile='out/steps_mlp_b4_w2.dat'; outfile='x.png'; plottitle='mlp_b4, world 2'" plot_steps.gp
if (!exists("datafile")) datafile = 'steps.dat'
if (!exists("outfile")) outfile = 'steps.png'
if (!exists("plottitle")) plottitle = ''
set terminal pngcairo size 1000,520 noenhanced
set output outfile
set title "step time vs bucket size: ".plottitle
set xlabel "bucket_cap_mb (MiB; 0 = one bucket per parameter)"
set ylabel "step time (ms)"
set datafile missing "?"
set grid
set key outside right top
set offsets 0.3, 0.3, 0, 0
set yrange [0:*]
# Columns: 1 index, 2 label, then median p25 p75 for local (3-5), naive (6-8), reducer (9-11),
# ours (12-14), ours_view (15-17), then the comm hooks at their one cap: reducer+fp16 (18-20),
# ours+fp16 (21-23), ours+bf16 (24-26), ours+powersgd1 (27-29), ours+powersgd4 (30-32). local and
# naive do not bucket: flat lines.
plot datafile using 1:3:xtic(2) with lines dt 2 lw 2 lc rgb "#4d4d4d" title "local", \
     '' using 1:6 with lines dt 3 lw 2 lc rgb "#b2182b" title "naive", \
     '' using 1:9:10:11 with yerrorlines lw 2 pt 7 lc rgb "#ef8a62" title "reducer", \
     '' using 1:12:13:14 with yerrorlines lw 2 pt 5 lc rgb "#2166ac" title "ours", \
     '' using 1:15:16:17 with yerrorbars pt 9 ps 1.5 lc rgb "#1b7837" title "ours_view", \
     '' using 1:18:19:20 with yerrorbars pt 4 ps 1.5 lc rgb "#d6604d" title "reducer+fp16", \
     '' using 1:21:22:23 with yerrorbars pt 6 ps 1.5 lc rgb "#4393c3" title "ours+fp16", \
     '' using 1:24:25:26 with yerrorbars pt 8 ps 1.5 lc rgb "#762a83" title "ours+bf16", \
     '' using 1:27:28:29 with yerrorbars pt 10 ps 1.5 lc rgb "#e08214" title "ours+powersgd1", \
     '' using 1:30:31:32 with yerrorbars pt 12 ps 1.5 lc rgb "#35978f" title "ours+powersgd4"
