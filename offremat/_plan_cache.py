"""Plans kept on disk between runs, keyed by everything a plan depends on.

A file holds one chain and its plan, under a key made of the model's structure (module types,
the code of their ``forward`` methods and of the functions those reach, parameter and buffer
shapes, dtypes and ``requires_grad``: :mod:`offremat._fingerprint`), the versions of torch and
of offremat's own code, the
device, the budget as given, the solver and its options, the example batch's signature and
the signature of the input shape planned. A file
that cannot be read, is truncated, has another format or another key, or holds a plan that
does not validate against its chain or does not fit its budget there, or whose chain the
caller cannot use, is logged and ignored: never fatal, never trusted. A plan read is scored on
its chain again, so its predictions are the simulator's, not the file's. Files are written to
a temporary name in the same folder and renamed over the target, so two processes writing the
same entry leave one whole file. The folder keeps the :data:`KEPT_FILES` entries used last
(read or written; a number that sizes tensors and changes at every step writes one at every
step), as the plans in memory are bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solvers.chain import Chain
from solvers.json_text import parse_json
from solvers.plan import Plan, validate
from solvers.simulator import score

logger = logging.getLogger(__name__)

# 2: buffer copies counted, module settings in the key; 3: changed buffers counted, code in it;
# 4: the code forward reaches and the library's versions in it; 5: the kind and bytes of the
# chain input a model's chain was profiled on, in its metadata; 6: a forward set on the
# instance in the key, and a digest of the chain and plan
FORMAT = "offremat.plan-cache/6"

# How every entry begins, whatever its format's version (json.dump writes "format" first).
_HEADER = b'{"format": "offremat.plan-cache/'

KEPT_FILES = 1024
"""How many entries a cache folder keeps: those read or written last."""


class PlanCache:
    """A folder of cached ``(chain, plan)`` pairs, one JSON file per key."""

    def __init__(self, directory: str | Path, key: dict[str, Any]):
        self.directory = Path(directory)
        self.loaded = 0  # entries read and trusted
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(
                f"cache_dir={str(directory)!r} is a file, or inside one: give a folder"
            ) from None
        self.key = key

    def _entry(self, signature: str) -> tuple[dict[str, Any], Path]:
        key = {**self.key, "signature": signature}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return key, self.directory / f"{digest[:32]}.json"

    def load(
        self, signature: str, check: Callable[[Chain, Plan], object] | None = None
    ) -> tuple[Chain, Plan] | None:
        """The cached chain and plan for ``signature``, or None (a bad file is logged).
        ``check`` raises ValueError, KeyError or TypeError where the caller cannot use them."""
        key, path = self._entry(signature)
        if not path.exists():
            return None
        try:
            data = parse_json(path.read_text(), "plan cache file")
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not an {FORMAT} file")
            if data.get("key") != key:
                raise ValueError("its key is another model's, device's, budget's or shape's")
            if data.get("digest") != _digest(data.get("chain"), data.get("plan")):
                # An edited chain can make a plan fit it, and a budget given as a fraction is
                # a fraction of the file's own chain: neither would be seen.
                raise ValueError("its chain or plan was changed after it was written")
            chain = Chain.from_dict(data["chain"])
            plan = Plan.from_dict(data["plan"])
            problems = validate(plan, chain)
            if problems:
                raise ValueError("; ".join(problems))
            if plan.budget_bytes is None and key.get("budget") != repr(None):
                raise ValueError("its plan has no budget, but one was asked for")
            plan = score(plan, chain, plan.budget_bytes)
            if not plan.feasible:
                raise ValueError(
                    f"its plan peaks at {plan.predicted_peak_bytes} B on its chain, over its "
                    f"budget of {plan.budget_bytes} B"
                )
            if check is not None:
                check(chain, plan)
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring plan cache file %s: %s", path, error)
            return None
        logger.info("plan for input %s read from %s", signature, path)
        self.loaded += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # used last: kept (see _evict)
        return chain, plan

    def store(self, signature: str, chain: Chain, plan: Plan) -> None:
        """Write the entry atomically (a temporary file renamed over it); log a failure."""
        key, path = self._entry(signature)
        chain_data, plan_data = chain.to_dict(), plan.to_dict()
        data = {
            "format": FORMAT,
            "key": key,
            "chain": chain_data,
            "plan": plan_data,
            "digest": _digest(chain_data, plan_data),
        }
        temporary: Path | None = None
        try:
            with tempfile.NamedTemporaryFile(
                "w", dir=self.directory, prefix=".tmp-", suffix=".json", delete=False
            ) as handle:
                temporary = Path(handle.name)
                json.dump(data, handle)
            os.replace(temporary, path)
        except OSError as error:
            logger.warning("could not write plan cache file %s: %s", path, error)
            if temporary is not None:
                temporary.unlink(missing_ok=True)
            return
        self._evict(path)

    def _evict(self, written: Path) -> None:
        """Remove all but the :data:`KEPT_FILES` entries used last (by modification time),
        ``written`` kept whatever the clock's resolution."""
        entries = []
        for entry in self.directory.glob("*.json"):
            # Entries alone, named as _entry names them and written as store writes them: the
            # folder may hold the user's files.
            if entry == written or not re.fullmatch(r"[0-9a-f]{32}\.json", entry.name):
                continue
            with contextlib.suppress(OSError), entry.open("rb") as handle:
                if handle.read(len(_HEADER)) == _HEADER:
                    entries.append((entry.stat().st_mtime_ns, entry))
        entries.sort()
        for _, entry in entries[: max(len(entries) + 1 - KEPT_FILES, 0)]:
            with contextlib.suppress(OSError):
                entry.unlink()


def _digest(chain: Any, plan: Any) -> str:
    """A digest of an entry's chain and plan as written (as JSON reads them back)."""
    written = json.loads(json.dumps([chain, plan]))
    return hashlib.sha256(json.dumps(written, sort_keys=True).encode()).hexdigest()
