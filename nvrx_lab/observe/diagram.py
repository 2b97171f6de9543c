"""The workbook's map: which process and which thread does what in the three layers (matplotlib)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

COLORS = {"launcher": "#f4d6a0", "worker": "#bcd7f0", "thread": "#e6f0fa", "writer": "#c9e8c3", "store": "#e8d3f0",
          "storage": "#dddddd"}


def _box(ax, x, y, w, h, text, color, size=8, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#333", lw=0.8))
    ax.text(x + w / 2, y + h - 0.12, text, ha="center", va="top", fontsize=size, weight=weight, wrap=True)


def _arrow(ax, a, b, text="", color="#333", style="-|>", at=None):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=color, lw=1))
    if text:
        x, y = at or ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.08)
        ax.text(x, y, text, ha="left", fontsize=7, color=color, backgroundcolor="white")


def draw_architecture(ranks: int = 2):
    """One node with ``ranks`` workers: the launcher and its rank monitors, each worker's threads, its
    checkpoint writer process, the stores, and shared storage. Returns the figure."""
    fig, ax = plt.subplots(figsize=(11, 6.2))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.6)
    ax.axis("off")
    _box(ax, 0.2, 4.9, 10.6, 1.5, "launcher process (python -m nvrx_lab.launcher) — layer 3", COLORS["launcher"], 9, "bold")
    _box(ax, 0.5, 5.0, 2.6, 0.9, "torchelastic agent:\nc10d rendezvous, restarts", COLORS["thread"])
    mon_x, mon_w = 3.4, 3.2 / ranks  # one rank monitor per local rank, each taking only its own rank's heartbeats
    for r in range(ranks):
        _box(ax, mon_x + r * mon_w + 0.04, 5.0, mon_w - 0.08, 0.9, f"rank {r} monitor:\nheartbeats,\nsections",
             COLORS["thread"], 7)
    _box(ax, 6.9, 5.0, 3.6, 0.9, "warm standby interpreters\n(torch imported, waiting to exec)", COLORS["thread"])
    width = 10.6 / ranks
    for r in range(ranks):
        x0 = 0.2 + r * width
        _box(ax, x0 + 0.05, 1.6, width - 0.1, 3.0, f"worker process, rank {r}", COLORS["worker"], 9, "bold")
        _box(ax, x0 + 0.2, 3.35, width - 0.4, 0.85, "main thread: train loop, FSDP2\ncollectives; ping(), "
                                                    "heartbeat", COLORS["thread"])
        _box(ax, x0 + 0.2, 2.45, width - 0.4, 0.8, "in-process monitor thread (layer 2):\nwatches store, interrupts + "
                                                   "aborts", COLORS["thread"])
        _box(ax, x0 + 0.2, 0.2, width - 0.4, 1.1, "checkpoint writer process (layer 1):\npersistent, reads staged "
                                                  "shared\nmemory, writes DCP shards", COLORS["writer"])
        _arrow(ax, (x0 + 0.6, 3.35), (x0 + 0.6, 1.3), "async_save: stage in shared memory → queue", "#2a7a2a",
               at=(x0 + 0.7, 1.38))
        monitor_x = mon_x + (r + 0.5) * mon_w  # this rank's monitor, straight above where the main thread allows
        beat_x = min(max(monitor_x, x0 + 0.5), x0 + width - 0.5)
        _arrow(ax, (beat_x, 4.2), (monitor_x, 5.0), "heartbeats", "#a0522d", at=(beat_x + 0.1, 4.62))
        store_x = 5.5 + (-0.6 if r == 0 else 0.6)
        _arrow(ax, (x0 + width / 2, 2.45), (store_x, 2.3), "", "#7b3f99", style="<|-|>")
    _box(ax, 4.3, 1.75, 2.4, 0.55, "wrapper TCPStore (MASTER_PORT+1):\nfaults, heartbeats, rendezvous", COLORS["store"], 7)
    ax.text(5.5, 0.05, "shared storage (FSx for Lustre on EKS; a local folder here): tmp dir → atomic commit",
            ha="center", fontsize=8, style="italic")
    ax.set_title("Who does what: launcher (in-job restart), in-process restart, async checkpointing", fontsize=11)
    fig.tight_layout()
    return fig
