"""`python -m experiments.report --workdir=W [--workdir=W2] [--out=FILE]`: see the package."""
import os

from absl import app, flags

from experiments.report import document
from lowrl.training import exits

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKDIR = flags.DEFINE_multi_string(
    "workdir", None, "An experiments.ablate workdir; give it again for another grid (e.g. "
    "configs/ablate_regime.py's): one report, one Holm family.", required=True)
_OUT = flags.DEFINE_string("out", os.path.join(_REPO, "docs", "results.md"),
                           "Markdown file to write (PNGs next to it).")


def main(argv):
  del argv
  with exits.one_line_exits():  # a missing or damaged results.jsonl: one line
    document.write_report(_WORKDIR.value, _OUT.value)
  print(f"[report] wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
