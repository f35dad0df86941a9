"""The report of `make mutants`: build/mutants/report.md for people and
report.json for tools.

Per file: mutants found, judged, killed (a test failed, crashed or timed
out), survived (every test passed), equivalent (survived, and listed in
targets.EQUIVALENT with the reason), invalid (did not compile: not
counted) and not run (the budget ran out). The score is killed over killed
plus survived: the share of the mutants a test could notice that one
did."""
from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from typing import Dict, List

STATUSES = ["killed", "timeout", "survived", "equivalent", "invalid", "not run"]


def judged(results: List[Dict[str, object]], equivalent: Dict[str, str]) -> List[Dict[str, object]]:
    """The results, a survivor listed as equivalent marked so (with its
    reason), and a listed one that was killed flagged (the list is stale)."""
    marked = []
    for result in results:
        result = dict(result)
        reason = equivalent.get(str(result["key"]))
        if reason is not None and result["status"] == "survived":
            result["status"], result["detail"] = "equivalent", reason
        elif reason is not None and result["status"] in ("killed", "timeout"):
            result["detail"] = f"listed as equivalent, yet killed: {result['detail']}"
        marked.append(result)
    return marked


def score(counts: Counter) -> str:
    caught = counts["killed"] + counts["timeout"]
    total = caught + counts["survived"]
    return f"{100 * caught / total:.1f}%" if total else "-"


def write(out: str, results: List[Dict[str, object]], found: List[object],
          equivalent: Dict[str, str], options: Dict[str, object]) -> str:
    """Writes both files into `out`; the path of report.md."""
    results = judged(results, equivalent)
    per_file: Dict[str, Counter] = defaultdict(Counter)
    for mutant in found:
        per_file[mutant.path]["found"] += 1
    for result in results:
        per_file[str(result["path"])][str(result["status"])] += 1
    total: Counter = Counter()
    for counts in per_file.values():
        total.update(counts)
    lines = [f"# Mutants ({time.strftime('%Y-%m-%d')})", "",
             f"Options: {json.dumps({k: v for k, v in options.items() if k != 'ctest'})}", "",
             "| file | found | killed | timeout | survived | equivalent | invalid | not run | score |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path, counts in sorted(per_file.items()) + [("all", total)]:
        cells = [str(counts[status]) for status in STATUSES]
        lines.append(f"| {path} | {counts['found']} | " + " | ".join(cells) + f" | {score(counts)} |")
    for status, title in (("survived", "Survivors"), ("equivalent", "Equivalent")):
        chosen = sorted((r for r in results if r["status"] == status),
                        key=lambda r: (r["path"], r["line"]))
        lines += ["", f"## {title} ({len(chosen)})", ""]
        lines += [f"- `{r['change']}`" + (f": {r['detail']}" if status == "equivalent" else "")
                  + f"  \n  key: `{r['key']}`" for r in chosen]
    stale = [r for r in results if str(r["detail"]).startswith("listed as equivalent")]
    if stale:
        lines += ["", "## Listed as equivalent, yet killed", ""]
        lines += [f"- `{r['key']}`" for r in stale]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as handle:
        json.dump({"options": options, "results": results}, handle, indent=1)
    path = os.path.join(out, "report.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return path
