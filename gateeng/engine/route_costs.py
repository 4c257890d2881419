"""The route's decode-pass costs (pricing.py), measured once per machine, build, model
and plan settings and kept beside the compiled kernels:

    cache_root()/route-costs/<key>.json    the facts, when the passes ran, their seconds,
                                           the CPU they got, and why pricing refused them

<key> hashes the facts a pass's cost depends on (route_prices.cost_facts names the
machine's, the build's, the model layout's and the settings'; pricing adds the
rows and keys it prices). The file holds the facts too, and one whose facts differ
from those asked for is a miss, so a key's 64 bits never serve another machine's
or model's costs.

Invariants:
- A file is written whole (disk.write_whole): a reader or a later start finds the
  old file, the new one or none, never a part of one.
- Timings that pricing refused (pricing.refusal) are written with why, and are
  never read back as costs.
- The cache can only save a start its timing, never stop one: a file that cannot
  be read or parsed is logged, removed and measured again, and one that cannot be
  written (a full disk, a read-only cache) is logged while the start goes on with
  what it measured.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gateeng.config import cache_root
from gateeng.disk import is_no_space, write_whole
from gateeng.logs import log

FOLDER = "route-costs"
FORMAT = 1   # the file's layout, part of the key


@dataclass(frozen=True)
class Stored:
    measured: list   # [(plan kind, rows, seconds)], as pricing.price_plans returned them
    when: str        # when the passes ran (UTC)
    path: Path
    cpu_share: Optional[float] = None   # of the CPU their threads asked for (pricing.QUIET_SHARE)
    refused: str = ""   # why pricing refused them ('' where it did not)


def path_for(facts: dict) -> Path:
    blob = json.dumps({"format": FORMAT, "facts": facts}, sort_keys=True)
    return cache_root() / FOLDER / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"


def load(facts: dict) -> Optional[Stored]:
    """The costs stored for `facts`, or None (none stored, another key's file, or an
    unreadable file, which is logged and removed)."""
    path = path_for(facts)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:   # ValueError: not JSON, not UTF-8
        return _unreadable(path, f"{type(exc).__name__}: {exc}")
    try:
        if record["format"] != FORMAT or record["facts"] != json.loads(json.dumps(facts)):
            return None
        measured = [(str(kind), int(rows), float(seconds)) for kind, rows, seconds in record["measured"]]
        share = record.get("cpu_share")
        return Stored(measured, str(record["measured_at"]), path, None if share is None else float(share),
                      str(record.get("refused") or ""))
    except (KeyError, TypeError, ValueError) as exc:
        return _unreadable(path, f"{type(exc).__name__}: {exc}")


def save(facts: dict, measured: list, cpu_share: Optional[float] = None, refused: str = "") -> Optional[Path]:
    """Stores `measured` for `facts`, with the share of the CPU the passes got and why
    they were refused where they were; the file's path, or None where it could not
    be written (logged)."""
    path = path_for(facts)
    record = {"format": FORMAT, "facts": facts, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "measured": [list(m) for m in measured], "cpu_share": cpu_share, "refused": refused}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    except OSError as exc:
        why = "no space left on its disk" if is_no_space(exc) else f"{type(exc).__name__}: {exc}"
        log(f"could not keep the route costs in {path} ({why}); the next start measures them again")
        return None
    return path


def _unreadable(path: Path, why: str) -> None:
    log(f"the route costs in {path} are unreadable ({why}); measuring them again")
    try:
        path.unlink()
    except OSError:
        pass   # a read-only cache: the next start finds it again and measures again
    return None
