#!/usr/bin/env python3
"""Whose code a cold round trip's code lines are (BENCHMARKS.md, bench 1, "Whose code the gap
is").

`footprint.sh` counts the code lines (last-level instruction misses) a round trip fetches; this
reads the callgrind outputs it keeps (`FOOTPRINT_KEEP=DIR bash ops/bench/footprint.sh`) and
charges each miss to the function it happened in and the source line it was charged to, as the
difference of the 1,200-round and the 200-round runs over 1,000: one round trip's. Code inlined
into a function counts as that function's (a `HashMap` lookup inlined into the session is the
session's), and a call's inclusive cost is not counted, so each miss counts once.

Usage:
  python3 ops/bench/footprint_by_source.py DIR                codex-fleet against the routing
                                                               floor, by crate of the function
  python3 ops/bench/footprint_by_source.py DIR fn PATTERN     the functions whose name contains
                                                               PATTERN, one by one
  python3 ops/bench/footprint_by_source.py DIR line PATTERN   the source lines of the files whose
                                                               path contains PATTERN, one by one
"""

import collections
import glob
import re
import signal
import sys

# The event counted: last-level instruction read misses (code lines, in footprint.sh's table).
EVENT = "ILmr"

# Crates grouped as the table shows them; any other crate is shown by its own name.
GROUPS = {
    "router": "codex-fleet's router crate (session, door, policy, admission)",
    "proto": "codex-fleet's proto and worker crates",
    "worker": "codex-fleet's proto and worker crates",
    "codex_fleet_bench": "the floor relay's own code",
    "tungstenite": "WebSocket (tungstenite, tokio-tungstenite)",
    "tokio_tungstenite": "WebSocket (tungstenite, tokio-tungstenite)",
    "rustls": "TLS (rustls, tokio-rustls, ring)",
    "tokio_rustls": "TLS (rustls, tokio-rustls, ring)",
    "ring": "TLS (rustls, tokio-rustls, ring)",
    "tokio": "tokio",
    "tokio_util": "tokio",
    "futures_util": "futures",
    "futures_core": "futures",
    "futures_task": "futures",
    "serde": "serde and serde_json",
    "serde_json": "serde and serde_json",
    "serde_core": "serde and serde_json",
    "hashbrown": "hash maps",
    "foldhash": "hash maps",
    "parking_lot": "locks (parking_lot)",
    "parking_lot_core": "locks (parking_lot)",
    "core": "core and std (not inlined)",
    "std": "core and std (not inlined)",
    "alloc": "core and std (not inlined)",
    "libc": "libc (malloc, memcpy, ...)",
}

# A table row smaller than this (code lines, either side) is summed into "others".
ROW = 3


def crate(function, obj):
    """The crate of a function as callgrind names it: the first path segment of the symbol, of
    its type in `<T as Trait>::f` (behind `&`, `&mut`, `*const`, `[`, `(`), of the dropped type
    in drop glue; libc's by its object; ring's assembly by its names."""
    if "libc.so" in obj or "ld-linux" in obj:
        return "libc"
    symbol = re.sub(r"^core::ptr::drop_in_place<", "", function)
    symbol = re.sub(r"^(<|&|mut |\*const |\*mut |dyn |\[|\()+", "", symbol)
    m = re.match(r"([A-Za-z_0-9]+)::", symbol)
    if m:
        return m.group(1)
    if re.match(r"_?(aesni|ring_core|gcm|ChaCha|x25519)", function):
        return "ring"
    return "symbols without a crate (impls on primitives, unnamed code)"


def parse(path):
    """Self cost of EVENT per (source file, line, function, object) in one callgrind output."""
    cost = collections.Counter()
    index = None
    obj = file = inlined = function = None
    last = 0
    skip_next = False
    # Callgrind names objects, files and functions by number after their first mention, each
    # kind in a table of its own.
    objects, files, functions = {}, {}, {}

    def named(table, value):
        m = re.match(r"\((\d+)\)(?: (.*))?$", value)
        if not m:
            return value
        if m.group(2) is not None:
            table[m.group(1)] = m.group(2)
        return table.get(m.group(1), "?")

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if c.isdigit() or c in "+-*":
                parts = line.split()
                p = parts[0]
                pos = last if p == "*" else last + int(p) if p[0] in "+-" else int(p)
                last = pos
                if skip_next:  # the inclusive cost of the call above: not this line's own
                    skip_next = False
                    continue
                values = parts[1:]
                if index < len(values) and values[index] != "*":
                    cost[(inlined or file, pos, function, obj)] += int(values[index])
                continue
            key, _, value = line.partition("=")
            if line.startswith("events:"):
                index = line.split()[1:].index(EVENT)
            elif key == "ob":
                obj = named(objects, value)
            elif key == "cob":
                named(objects, value)
            elif key == "fl":
                file, inlined = named(files, value), None
            elif key in ("fi", "fe"):
                inlined = named(files, value)
            elif key in ("cfl", "cfi"):
                named(files, value)
            elif key == "fn":
                function = named(functions, value)
            elif key == "cfn":
                named(functions, value)
            elif key == "calls":
                skip_next = True
    return cost


def per_round_trip(work, who):
    runs = [glob.glob(f"{work}/{who}.{rounds}.*.out") for rounds in (200, 1200)]
    if any(len(found) != 1 for found in runs):
        sys.exit(f"{work}: not one {who}.200.*.out and one {who}.1200.*.out (FOOTPRINT_KEEP's)")
    [[short], [long]] = runs
    short, long = parse(short), parse(long)
    return {k: (long.get(k, 0) - short.get(k, 0)) / 1000 for k in set(short) | set(long)}


def listing(fleet, route, key):
    """Each key's code lines in codex-fleet and the routing floor, largest first."""
    by = [collections.Counter(), collections.Counter()]
    for counter, costs in zip(by, [fleet, route]):
        for k, v in costs.items():
            shown = key(k)
            if shown is not None:
                counter[shown] += v
    f, r = by
    for shown in sorted(set(f) | set(r), key=lambda k: -(f[k] + r[k])):
        if abs(f[shown]) >= 0.5 or abs(r[shown]) >= 0.5:
            print(f"{f[shown]:6.1f} {r[shown]:6.1f}  {shown}")


def signed(x):
    """A difference as the table shows it: `+8`, `-16`, `0` (never `-0`)."""
    return f"{x:+.0f}" if round(x) else "0"


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a reader that stops early (`| head`) ends it
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and sys.argv[2] not in ("fn", "line")):
        sys.exit(__doc__)
    work = sys.argv[1]
    fleet = per_round_trip(work, "fleet")
    route = per_round_trip(work, "floor-route")
    if len(sys.argv) == 4:
        pattern = sys.argv[3]
        if sys.argv[2] == "fn":
            listing(fleet, route, lambda k: k[2][:160] if pattern in (k[2] or "") else None)
        else:
            listing(fleet, route, lambda k: f"{k[0]}:{k[1]}" if pattern in (k[0] or "") else None)
        return
    by = [collections.Counter(), collections.Counter()]
    for counter, costs in zip(by, [fleet, route]):
        for (_, _, function, obj), v in costs.items():
            c = crate(function or "?", obj or "")
            counter[GROUPS.get(c, c)] += v
    f, r = by
    print("| whose code (code lines per round trip) | codex-fleet | routing floor | difference |")
    print("|---|---|---|---|")
    others = [0.0, 0.0]
    for label in sorted(set(f) | set(r), key=lambda k: -(f[k] - r[k])):
        if abs(f[label]) >= ROW or abs(r[label]) >= ROW:
            print(f"| {label} | {f[label]:.0f} | {r[label]:.0f} | {signed(f[label] - r[label])} |")
        else:
            others[0] += f[label]
            others[1] += r[label]
    a, b = others
    print(f"| others, each under {ROW} | {a:.0f} | {b:.0f} | {signed(a - b)} |")
    tf, tr = sum(f.values()), sum(r.values())
    print(f"| all | {tf:.0f} | {tr:.0f} | {signed(tf - tr)} |")


if __name__ == "__main__":
    main()
