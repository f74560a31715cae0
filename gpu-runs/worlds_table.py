"""Which rule of ambiguity would have judged a recording's replies rightly: a table read from golden_worlds.py's output.

    python3 gpu-runs/worlds_table.py OUTDIR/NAME/worlds.json [...]

For each file (one model's recording, its distinct replies to the long
prompts, scored in the worlds gpu-runs/golden_worlds.py names) and each rule
(the golden alone, with its alternate world at 4, 1 and 0.25 epsilons, with
float32, with other roundings): the share of positions a world leaves
ambiguous (another first token), the largest margin (the smallest of the
rule's worlds') at which the served token is not the golden's, and, over
margins of 0.5 to 3 nats, the share of positions over it and how many of them
the engine disagreed at. A position counts once per distinct reply, whatever
number of requests sent it. A measurement, never a judgement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RULES = (("P",), ("P", "A4"), ("P", "A1"), ("P", "A0.25"), ("P", "F"), ("P", "J0.01s1"), ("P", "J0.1s1", "J0.1s2"),
         ("P", "J0.1s1", "J0.1s2", "J0.1s4"), ("P", "J0.3s3", "J0.3s5"))
MARGINS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


def rows(data: dict) -> list[str]:
    out = []
    for rule in RULES:
        if not all(w in data["worlds"] for w in rule):
            continue
        positions = ambiguous = 0
        over = {t: [0, 0] for t in MARGINS}
        worst = 0.0
        for entry in data["prompts"].values():
            for reply in entry["replies"]:
                worlds = reply["worlds"]
                for j, served in enumerate(reply["ids"]):
                    positions += 1
                    first = worlds["P"][j][0]
                    if any(worlds[w][j][0] != first for w in rule):
                        ambiguous += 1
                        continue
                    margin = min(worlds[w][j][2] - worlds[w][j][3] for w in rule)
                    if served != first:
                        worst = max(worst, margin)
                    for t in MARGINS:
                        if margin > t:
                            over[t][0] += 1
                            over[t][1] += served != first
        cells = " | ".join(f"{n / positions:.0%} / {bad}" for n, bad in over.values())
        out.append(f"| {' + '.join(rule)} | {ambiguous / positions:.1%} | {worst:.2f} | {cells} |")
    return out


def main(argv: list[str]) -> int:
    for path in argv:
        data = json.loads(Path(path).read_text())
        positions = sum(len(r["ids"]) for e in data["prompts"].values() for r in e["replies"])
        print(f"{path}: {len(data['prompts'])} prompts, {positions} positions, {data['device']}\n")
        print("| worlds | ambiguous | largest margin the engine disagreed at | "
              + " | ".join(f"over {t} (share / disagreeing)" for t in MARGINS) + " |")
        print("|---" * (3 + len(MARGINS)) + "|")
        print("\n".join(rows(data)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
