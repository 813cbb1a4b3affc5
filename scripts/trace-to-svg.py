#!/usr/bin/env python3
"""Draws the per-rank timelines that ACCELERATE_TRACE writes (trace_rank_<r>.json, Chrome
trace-event files) as one SVG picture: a lane per rank and thread, a row per nesting depth,
each phase coloured by name and labelled where it is wide enough, with a time axis in ms.

    python3 scripts/trace-to-svg.py TRACE_DIR OUT.svg [--steps N]

--steps N draws only the last N steps of rank 0's timeline (default: everything kept).
Pure Python, no packages: for a quick look; ui.perfetto.dev opens the same files.
"""

import html
import json
import pathlib
import sys

COLOURS = {
    "step": "#e8e8e8", "data_wait": "#f2c14e", "forward": "#4e79a7", "backward": "#e15759",
    "optimizer": "#59a14f", "ema": "#76b7b2", "checkpoint": "#b07aa1",
}
COLLECTIVE = "#f28e2b"
ROW, GAP, LEFT, WIDTH = 18, 10, 90, 1100


def colour(name):
    if name in COLOURS:
        return COLOURS[name]
    if name.startswith(("all_", "broadcast", "reduce_scatter", "barrier", "shared_buffer")):
        return COLLECTIVE
    return "#bab0ac"


def depths(events):
    """Row of each event: how many open events on its thread contain it."""
    out, stack = [], []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        end = e["ts"] + e["dur"]
        while stack and stack[-1] < e["ts"] + 1e-3:
            stack.pop()
        out.append((e, len(stack)))
        stack.append(end)
    return out


def main():
    args = sys.argv[1:]
    steps = None
    if "--steps" in args:
        i = args.index("--steps")
        steps = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    folder, out = pathlib.Path(args[0]), pathlib.Path(args[1])
    ranks = {}
    # trace_rank_<r>.json, or trace_rank_<r>_<k>.json beside an earlier run's: the newest.
    for path in sorted(folder.glob("trace_rank_*.json"), key=lambda p: p.stat().st_mtime):
        events = json.loads(path.read_text())["traceEvents"]
        rank = int(path.stem[len("trace_rank_"):].split("_")[0])
        ranks[rank] = [e for e in events if e.get("ph") == "X"]
    if not ranks:
        sys.exit(f"no trace_rank_*.json in {folder}")
    first = ranks[min(ranks)]
    kept = sorted((e for e in first if e["name"] == "step"), key=lambda e: e["ts"])
    if steps and kept:
        kept = kept[-steps:]
    # Every rank's clock starts at its own process start: align each rank on its first kept
    # step that matches rank 0's (the same update number), else on its first event.
    start = kept[0]["ts"] if kept else min(e["ts"] for e in first)
    end = kept[-1]["ts"] + kept[-1]["dur"] if kept else max(e["ts"] + e["dur"] for e in first)
    first_update = kept[0]["args"].get("update") if kept else None
    lanes = []
    for rank, events in sorted(ranks.items()):
        offset = 0.0
        mine = [e for e in events if e["name"] == "step" and e["args"].get("update") == first_update]
        if mine:
            offset = mine[0]["ts"] - start
        by_thread = {}
        for e in events:
            ts = e["ts"] - offset
            if ts + e["dur"] >= start and ts <= end:
                by_thread.setdefault(e["tid"], []).append(dict(e, ts=ts))
        for tid, evs in sorted(by_thread.items()):
            placed = depths(evs)
            lanes.append((f"rank {rank}" + (f" t{tid}" if len(by_thread) > 1 else ""), placed))
    span = max(end - start, 1.0)
    x = lambda ts: LEFT + (ts - start) / span * WIDTH
    y, body = 30, []
    for label, placed in lanes:
        rows = max(d for _, d in placed) + 1
        body.append(f'<text x="8" y="{y + ROW - 5}" class="lane">{label}</text>')
        for e, d in placed:
            x0, x1 = max(x(e["ts"]), LEFT), min(x(e["ts"] + e["dur"]), LEFT + WIDTH)
            if x1 - x0 < 0.3:
                continue
            top = y + d * ROW
            args = ", ".join(f"{k}={v}" for k, v in e.get("args", {}).items())
            tip = html.escape(f'{e["name"]} {e["dur"] / 1e3:.2f} ms {args}')
            body.append(
                f'<rect x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{ROW - 2}" '
                f'fill="{colour(e["name"])}"><title>{tip}</title></rect>')
            if x1 - x0 > 7 * len(e["name"]):
                body.append(f'<text x="{x0 + 3:.1f}" y="{top + ROW - 6}">{html.escape(e["name"])}</text>')
        y += rows * ROW + GAP
    ticks = []
    # Ticks at a round interval (1, 2 or 5 times a power of ten ms), about eight of them.
    step_ms = 1
    while span / 1e3 / step_ms > 8:
        step_ms *= 5 if str(step_ms)[0] == "2" else 2
    t = 0
    while t * 1e3 <= span:
        tx = x(start + t * 1e3)
        ticks.append(f'<line x1="{tx:.1f}" y1="{y}" x2="{tx:.1f}" y2="{y + 5}" stroke="#555"/>'
                     f'<text x="{tx:.1f}" y="{y + 17}" text-anchor="middle">{t} ms</text>')
        t += step_ms
    legend, lx = [], LEFT
    for name, c in list(COLOURS.items()) + [("collective", COLLECTIVE)]:
        legend.append(f'<rect x="{lx}" y="{y + 28}" width="12" height="12" fill="{c}"/>'
                      f'<text x="{lx + 16}" y="{y + 38}">{name}</text>')
        lx += 24 + 7 * len(name)
    height = y + 50
    out.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
        f'font-family="sans-serif" font-size="11">'
        '<style>.lane { font-weight: bold }</style>'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="8" y="18" font-size="13">accelerate-rs timeline: {len(ranks)} ranks, '
        f'{len(kept)} steps ({span / 1e3:.0f} ms)</text>'
        + "".join(body) + "".join(ticks) + "".join(legend) + "</svg>\n")


if __name__ == "__main__":
    main()
