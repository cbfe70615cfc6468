#!/usr/bin/env python3
"""Whose code a cold round trip's code lines are (BENCHMARKS.md, bench 1, "Whose code
the gap is").

`footprint.sh` counts the distinct code lines (last-level instruction misses) a round trip
touches; this reads the callgrind outputs it keeps (`FOOTPRINT_KEEP=DIR bash
ops/bench/footprint.sh`) and charges each miss to the function it happened in, as the difference
of the 1,200-round and the 200-round runs over 1,000: one round trip's. Code inlined into a
function counts as that function's (a `HashMap` lookup inlined into the session is the
session's), and calls' inclusive costs are not counted, so each miss counts once.

Usage: python3 ops/bench/footprint_by_source.py DIR            codex-fleet against the routing
                                                                floor, by crate of the function
       python3 ops/bench/footprint_by_source.py DIR PATTERN    the functions whose name contains
                                                                PATTERN, one by one
"""

import collections
import glob
import re
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
    "serde_json": "serde_json",
    "serde_core": "serde_json",
    "hashbrown": "hash maps",
    "foldhash": "hash maps",
    "parking_lot": "locks (parking_lot)",
    "parking_lot_core": "locks (parking_lot)",
    "core": "core and std (not inlined)",
    "std": "core and std (not inlined)",
    "alloc": "core and std (not inlined)",
    "libc": "libc (malloc, memcpy)",
}


def crate(function):
    """The crate of a symbol as callgrind names it (a symbol without a path: ring's assembly, or
    libc)."""
    m = re.match(r"(?:core::ptr::drop_in_place<)?<*([A-Za-z_0-9]+)(::|$| as )", function)
    if m and "::" in function:
        return m.group(1)
    if re.match(r"_?aesni|ring_core|_?gcm|ChaCha|_?x25519", function):
        return "ring"
    return "libc"


def parse(path):
    """Self cost of EVENT per (source file, line, function) in one callgrind output."""
    names = {}
    cost = collections.Counter()
    index = None
    file = inlined = function = None
    last = 0
    skip_next = False

    def name(value):
        m = re.match(r"\((\d+)\)(?: (.*))?$", value)
        if not m:
            return value
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "?")

    fn_names = {}

    def fn_name(value):
        m = re.match(r"\((\d+)\)(?: (.*))?$", value)
        if not m:
            return value
        if m.group(2) is not None:
            fn_names[m.group(1)] = m.group(2)
        return fn_names.get(m.group(1), "?")

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
                    cost[(inlined or file, pos, function)] += int(values[index])
                continue
            key, _, value = line.partition("=")
            if line.startswith("events:"):
                index = line.split()[1:].index(EVENT)
            elif key == "fl":
                file, inlined = name(value), None
            elif key in ("fi", "fe"):
                inlined = name(value)
            elif key in ("cfl", "cfi"):
                name(value)
            elif key == "fn":
                function = fn_name(value)
            elif key == "cfn":
                fn_name(value)
            elif key == "calls":
                skip_next = True
    return cost


def per_round_trip(work, who):
    short = parse(glob.glob(f"{work}/{who}.200.*.out")[0])
    long = parse(glob.glob(f"{work}/{who}.1200.*.out")[0])
    return {k: (v - short.get(k, 0)) / 1000 for k, v in long.items()}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    work = sys.argv[1]
    fleet = per_round_trip(work, "fleet")
    route = per_round_trip(work, "floor-route")
    if len(sys.argv) > 2:
        pattern = sys.argv[2]
        by = [collections.Counter(), collections.Counter()]
        for counter, costs in zip(by, [fleet, route]):
            for (_, _, function), v in costs.items():
                if pattern in (function or ""):
                    counter[function] += v
        f, r = by
        for function in sorted(set(f) | set(r), key=lambda k: -(f[k] + r[k])):
            if abs(f[function]) >= 0.5 or abs(r[function]) >= 0.5:
                print(f"{f[function]:6.1f} {r[function]:6.1f}  {function[:160]}")
        return
    by = [collections.Counter(), collections.Counter()]
    for counter, costs in zip(by, [fleet, route]):
        for (_, _, function), v in costs.items():
            name = crate(function or "?")
            counter[GROUPS.get(name, name)] += v
    f, r = by
    print("| whose code (code lines per round trip) | codex-fleet | routing floor | difference |")
    print("|---|---|---|---|")
    for label in sorted(set(f) | set(r), key=lambda k: -(f[k] - r[k])):
        if abs(f[label]) >= 3 or abs(r[label]) >= 3:
            print(f"| {label} | {f[label]:.0f} | {r[label]:.0f} | {f[label] - r[label]:+.0f} |")
    tf, tr = sum(f.values()), sum(r.values())
    print(f"| all | {tf:.0f} | {tr:.0f} | {tf - tr:+.0f} |")


if __name__ == "__main__":
    main()
