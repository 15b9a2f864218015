#!/usr/bin/env bash
# The commands the README shows, checked as written against this checkout and its build: every
# `bash <script>` names a script that exists; every ./build/<path> is a program the build made;
# every option given to ddprun is one `ddprun --help` lists; every option given to an example
# program or ddp_bench is one its sources define. (The two commands themselves run in CI.)
#   readme_commands_test.sh SOURCE_DIR BUILD_DIR
set -u -o pipefail
src=$1 build=$2
failures=0
fail() { echo "FAIL: $1"; failures=$((failures + 1)); }

# Inline commands (`bash ...`, `./build/...`) and the lines of ```bash blocks, comments dropped.
commands=$( { grep -oE '`(bash |\./build/)[^`]+`' "$src/README.md" | tr -d '`'
              awk '/^```bash/{f=1;next} /^```/{f=0} f' "$src/README.md" | sed 's/[[:space:]]#.*$//'; } |
            grep -v '^[[:space:]]*$' | grep -v '^[[:space:]]*#' | sort -u)
help=$("$build/launch/ddprun" --help 2>&1)
checked=0
while IFS= read -r line; do
  read -r -a words <<<"$line"
  program=""   # the program ddprun starts, or the one the line runs
  in_ddprun=0
  for ((i = 0; i < ${#words[@]}; ++i)); do
    word=${words[i]}
    case $word in
      bash)
        script=${words[i + 1]:-}
        [[ -z $script || -f $src/$script ]] || fail "README runs 'bash $script', which does not exist ($line)"
        ;;
      ./build/*)
        [[ -x $build/${word#./build/} ]] || fail "README runs $word, which the build did not make ($line)"
        if [[ $word == */ddprun ]]; then in_ddprun=1; else in_ddprun=0; program=$word; fi
        ;;
      ddprun) in_ddprun=1 ;;
      --) in_ddprun=0 ;;
      -*)
        if ((in_ddprun)); then
          flag=${word%%=*}
          grep -qE -- "(^|[^-[:alnum:]])${flag}([^-[:alnum:]]|\$)" <<<"$help" || fail "ddprun --help does not list $word ($line)"
        elif [[ $program == ./build/examples/* || $program == ./build/benchmarks/* ]]; then
          dir=$src/${program#./build/}; dir=${dir%/*}
          grep -rqF -- "${word#--}" "$dir" "$src/examples/common" 2>/dev/null ||
            fail "$program has no option $word in its sources ($line)"
        fi
        ;;
      ./*) ((in_ddprun)) && in_ddprun=0 ;;  # the program ddprun starts (./my_trainer): its options are its own
    esac
  done
  checked=$((checked + 1))
done <<<"$commands"
echo "checked $checked README commands"
[ "$failures" -eq 0 ] && echo "PASS: readme commands"
exit $((failures > 0))
