# Sourced: torch_without_libuv PYTHON
# Debian's torch 2.6 is built without libuv, yet its torchrun asks TCPStore for libuv (the default)
# and fails before starting any rank ("use_libuv was requested but PyTorch was build without libuv
# support"). Not ours to fix: where that happens, a sitecustomize (in a temporary folder, removed
# at exit) makes TCPStore default to use_libuv=False for the processes this shell starts.
torch_without_libuv() {
  "$1" -c 'import torch.distributed as d; d.TCPStore("127.0.0.1", 0, 1, True)' >/dev/null 2>&1 && return 0
  local shim
  shim=$(mktemp -d)
  # shellcheck disable=SC2064  # the folder is known now
  trap "rm -rf '$shim'" EXIT
  printf '%s\n' 'import torch.distributed as d' 'class TCPStore(d.TCPStore):' \
    '    def __init__(self, *args, **kwargs):' '        kwargs.setdefault("use_libuv", False)' \
    '        super().__init__(*args, **kwargs)' 'd.TCPStore = TCPStore' >"$shim/sitecustomize.py"
  export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
  export USE_LIBUV=0  # the ranks' own env:// rendezvous passes use_libuv from this variable
}
