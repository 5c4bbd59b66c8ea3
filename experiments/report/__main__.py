"""`python -m experiments.report --workdir=W [--workdir=W2] [--out=FILE] [--note=TEXT ...]`: see the
package."""
import os

from absl import app, flags

from experiments.report import document
from lowrl.training import exits

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKDIR = flags.DEFINE_multi_string(
    "workdir", None, "An experiments.ablate workdir; give it again for another grid (e.g. "
    "configs/ablate_regime.py's): one report, one Holm family.", required=True)
_DEFAULT_OUT = os.path.join(_REPO, "docs", "results.md")
_OUT = flags.DEFINE_string("out", _DEFAULT_OUT, "Markdown file to write (PNGs next to it).")
_NOTE = flags.DEFINE_multi_string(
    "note", [], "A paragraph on how the grids ran that their files do not record (the "
    "machine's load, pauses, the code's commit); give it again for another. Printed as given.")


def command() -> str:
  """This report's command line (the notes' text is printed beside it, not in it)."""
  args = [f"--workdir={w}" for w in _WORKDIR.value]
  if os.path.abspath(_OUT.value) != _DEFAULT_OUT:
    args.append(f"--out={_OUT.value}")
  args += ["--note=<each note below>"] * bool(_NOTE.value)
  return " ".join(["python -m experiments.report", *args])


def main(argv):
  del argv
  with exits.one_line_exits():  # a missing or damaged results.jsonl: one line
    document.write_report(_WORKDIR.value, _OUT.value, notes=_NOTE.value, command=command())
  print(f"[report] wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
