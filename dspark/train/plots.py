"""Learning curves of a training run, drawn from its `log.jsonl`:

    python -m dspark.train.plots runs/dspark/log.jsonl docs/figures/train_dspark.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_training_log(log_jsonl: str | Path, out_png: str | Path) -> Path:
    """Loss terms and acceptance (position 1 and the expected acceptance
    length) against the step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(log_jsonl).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r and "step" in r]
    if not rows:
        raise ValueError(f"{log_jsonl} holds no training steps")
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in ("loss", "tv", "conf"):
        ax_loss.plot(steps, [r[key] for r in rows], label=key)
    ax_loss.plot(steps, [r["ce"] / 10 for r in rows], label="ce / 10")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("loss terms")
    ax_loss.legend()
    ax_acc.plot(steps, [r["accept_per_position"][0] for r in rows], label="acceptance, position 1")
    ax_acc.plot(steps, [r["expected_accept_len"] - 1 for r in rows], label="expected tau - 1")
    ax_acc.set_xlabel("step")
    ax_acc.set_title("acceptance (training batches)")
    ax_acc.legend()
    return save_figure(fig, out_png)


def save_figure(fig, out_png: str | Path, dpi: int = 110) -> Path:
    """Lay out, write (creating the folder) and close a pyplot figure; return its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot_training_log(sys.argv[1], sys.argv[2]))
