"""The main job (examples/train_fashion_mnist) in Python, with PyTorch's own DistributedDataParallel.

The same model, parameter initialization, data, per-rank order, optimizer, batch size, bucket sizes
and test evaluation as the C++ program, over Gloo, started by torchrun; rank 0 prints the same
lines, so one script can read both and compare samples/s (benchmarks/main_job_vs_python.sh).

    torchrun --standalone --nproc-per-node 2 benchmarks/python_peer/train_fashion_mnist.py --epochs 1
    python benchmarks/python_peer/train_fashion_mnist.py --epochs 1     # alone: a world of one

Only the standard library and torch (no numpy, no torchvision): it runs in a bare torch venv.
"""
import argparse
import datetime
import gzip
import os
import struct
import sys
import time
import warnings

# The torch wheel warns at import when numpy is absent; this program does not use numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402 (after the filter)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

# examples/train_fashion_mnist/fashion_mnist.h: where Debian's dataset-fashion-mnist puts the files,
# and the training pixels' mean and standard deviation (scaled to [0, 1]).
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN = 0.2860
STD = 0.3530
CLASSES = 10


def read_idx(path, magic):
    """The dims and the uint8 elements of a gzipped IDX file, checked as the C++ reader checks them."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        sys.exit(f"train_fashion_mnist.py: cannot open {path}; install Debian's dataset-fashion-mnist package "
                 "or point --data-dir at a folder holding the four *-ubyte.gz files")
    dims = magic & 0xFF
    header = 4 + 4 * dims
    if len(data) < header or struct.unpack(">I", data[:4])[0] != magic:
        sys.exit(f"train_fashion_mnist.py: {path} is not an IDX file with magic 0x{magic:08x}")
    shape = struct.unpack(f">{dims}I", data[4:header])
    count = 1
    for d in shape:
        count *= d
    if len(data) != header + count:
        sys.exit(f"train_fashion_mnist.py: {path} holds {len(data)} bytes, expected {header + count}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).view(*shape)


class FashionMNIST(Dataset):
    """examples::FashionMNIST: images [N, 1, 28, 28] float normalized as (pixel / 255 - MEAN) / STD
    (the same float32 operations in the same order), labels [N] int64; one example per index."""

    def __init__(self, split, data_dir, limit=0):
        prefix = "train" if split == "train" else "t10k"
        images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 0x00000803)
        labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 0x00000801)
        if limit > 0:  # FashionMNIST::head: the first `limit` samples
            images, labels = images[:limit], labels[:limit]
        self.images = images.unsqueeze(1).to(torch.float32).div_(255).sub_(MEAN).div_(STD)
        self.labels = labels.to(torch.int64)

    def __len__(self):
        return self.labels.numel()

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class Net(nn.Module):
    """The main job's Net: modules built in the same order, so after the same manual_seed the
    default initialization draws the same numbers as LibTorch's C++ modules do."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # [N, 16, 14, 14]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # [N, 32, 7, 7]
        return self.fc2(F.relu(self.fc1(x.flatten(1))))  # logits [N, 10]


def all_reduce_sums(values):
    """ddp::Metrics::all_reduce: every rank's (sum, count) pairs summed over the ranks, in float64."""
    packed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(packed)
    return packed.tolist()


def evaluate(net, test, batch_size, rank, world):
    """Loss and accuracy over the whole test set, sharded as the main job's DistributedSampler with
    pad(false) shards it: rank r takes samples r, r + world, ..., so every sample counts once."""
    loader = DataLoader(test, batch_size=batch_size, sampler=range(rank, len(test), world))
    net.eval()
    loss = correct = count = 0.0
    with torch.no_grad():
        for images, labels in loader:
            output = net(images)
            loss += F.cross_entropy(output, labels, reduction="sum").item()
            correct += output.argmax(1).eq(labels).sum().item()
            count += labels.numel()
    net.train()
    return all_reduce_sums([loss, correct, count])


def parse_args():
    parser = argparse.ArgumentParser(description="The main job (Fashion-MNIST CNN) with PyTorch's Python DDP")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="gradient bucket size in MiB (default: PyTorch's, 25 with a 1 MiB first bucket, as "
                             "the main job's defaults; a value given here is also the first bucket's, as in PyTorch)")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and shuffle seed")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="folder with the Fashion-MNIST *-ubyte.gz files")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a collective may wait for the others")
    parser.add_argument("--limit-train", type=int, default=0, help="use only the first N training samples (0: all)")
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    # torchrun sets WORLD_SIZE (env://); started alone, a world of one, as the main job.
    timeout = datetime.timedelta(seconds=args.timeout)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(args.backend, timeout=timeout)
    else:
        dist.init_process_group(args.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    rank = dist.get_rank()
    world = dist.get_world_size()
    leader = rank == 0

    train = FashionMNIST("train", args.data_dir, args.limit_train)
    test = FashionMNIST("test", args.data_dir)

    torch.manual_seed(args.seed)  # the same start everywhere (DDP also broadcasts rank 0's)
    net = Net()
    # Bucket sizes: left to PyTorch unless given (bucket_cap_mb=None means 25 MiB with a 1 MiB first
    # bucket in torch 2.x; torch 1.x takes no None but has the same defaults).
    ddp_options = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DistributedDataParallel(net, **ddp_options)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    if leader:
        print(f"train_fashion_mnist.py: world {world} ({args.backend}), batch {args.batch_size} per rank "
              f"({args.batch_size * world} global), lr {args.lr:g}, {len(train)} train / {len(test)} test samples, "
              f"{args.threads} thread(s) per rank, torch {torch.__version__}, optimizer Adam", flush=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        label = f"epoch {epoch + 1}/{args.epochs}"
        loss_sum = correct = count = 0.0
        start = time.perf_counter()
        for images, labels in loader:
            output = model(images)
            loss = F.cross_entropy(output, labels)
            optimizer.zero_grad()
            loss.backward()  # averaged gradients arrive here
            optimizer.step()
            n = labels.numel()
            loss_sum += loss.item() * n
            correct += output.argmax(1).eq(labels).sum().item()
            count += n
        loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count])  # also waits for the slowest rank
        seconds = time.perf_counter() - start
        test_loss, test_correct, test_count = evaluate(net, test, args.batch_size, rank, world)
        if leader:
            print(f"{label}: train loss {loss_sum / count:.4f} acc {100 * correct / count:.2f}% | "
                  f"test loss {test_loss / test_count:.4f} acc {100 * test_correct / test_count:.2f}% "
                  f"({test_count:.0f} samples) | {count / seconds:.0f} samples/s, {seconds:.1f} s", flush=True)
    dist.destroy_process_group()
    if torch.__version__.startswith("1."):
        # torch 1.13 can deadlock at exit (1 run in ~12 here): DDP's Reducer, freed with the GIL
        # held, destroys the Gloo group, which waits on its lock while a Gloo thread holding that
        # lock waits for the GIL. Training is over and printed: leave without destructors.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
