# Sourced by the example tests (apex_recipe_test.sh, gan_test.sh): strict mode, a temporary
# directory $dir removed on exit, and fail MESSAGE, which prints the message and the last output
# ($out) and exits 1.
set -u -o pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "${out:-}"
  exit 1
}
