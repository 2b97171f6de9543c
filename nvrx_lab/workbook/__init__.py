"""Notebook parameters, checked: what a notebook's first cell after its ``parameters`` cell calls.

A notebook's ``parameters`` cell holds literals only (papermill overrides them with ``-p NAME VALUE``);
a size that depends on the smoke switch is ``None`` there, and resolved here, so that the small CPU
configuration never silently replaces a value the user set::

    # parameters (tagged)
    steps: Optional[int] = None  # None: 12 in the smoke configuration, 40 at full size
    nproc: int = 2  # ranks on this machine
    smoke: Optional[bool] = None  # None: from $NVRX_LAB_SMOKE (unset or 1: small CPU config, 0: full size)

    # the next cell
    from nvrx_lab.workbook import Parameters
    p = Parameters(smoke)
    smoke = p.smoke
    steps = p.int("steps", steps, min=1, smoke=12, full=40)
    nproc = p.int("nproc", nproc, min=1, max=8)
    p.done()  # prints one line: every value and where it came from

papermill turns ``-p steps ten`` into the string ``"ten"`` and ``-p smoke maybe`` into ``"maybe"``: each is a
:class:`ParameterError` of one line that names the parameter, what it got and what would be valid (``why=``
adds where a range comes from), raised before the notebook starts any process. ``tests/test_notebooks_format.py``
holds every notebook to this shape: one check per parameter, ``p.done()`` last, and no later cell that binds a
parameter's name again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

SMOKE_ENV = "NVRX_LAB_SMOKE"


class ParameterError(ValueError):
    """A notebook parameter that cannot be used: one line naming it, what it got and what is valid."""


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def parse_smoke(value: Any, env: str | None = None) -> bool:
    """The smoke switch: ``True``/``False`` (or 1/0) as given, else ``$NVRX_LAB_SMOKE`` (unset or 1: smoke)."""
    if value is None:
        text = os.environ.get(SMOKE_ENV, "1") if env is None else env
        if text.strip() not in ("0", "1"):
            raise ParameterError(f"${SMOKE_ENV} must be 0 (full size) or 1 (the small CPU configuration), got {text!r}")
        return text.strip() == "1"
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ParameterError(f"parameter smoke: expected True or False (or None: from ${SMOKE_ENV}), got {_got(value)}")


class Parameters:
    """Checks one notebook's parameters against their type and range, one call each (see the module docs)."""

    def __init__(self, smoke: Any = None):
        self.smoke = parse_smoke(smoke)
        self.values: dict[str, tuple[Any, str]] = {"smoke": (self.smoke, "given" if smoke is not None else f"${SMOKE_ENV}")}

    def _default(self, name: str, value: Any, smoke: Any, full: Any) -> tuple[Any, str]:
        if value is not None:
            return value, "given"
        if smoke is None and full is None:
            raise ParameterError(f"parameter {name}: None is not a value here; pass one")
        return (smoke, "smoke default") if self.smoke else (full, "full-size default")

    def _keep(self, name: str, value: Any, how: str) -> Any:
        self.values[name] = (value, how)
        return value

    def int(self, name: str, value: Any, min: int | None = None, max: int | None = None,
            smoke: int | None = None, full: int | None = None, choices: Iterable[int] | None = None,
            why: str | None = None) -> int:
        """An integer in ``[min, max]`` (one of ``choices`` when given); ``None`` takes the ``smoke`` or
        ``full`` default. ``why`` says, in the error, what the range comes from."""
        value, how = self._default(name, value, smoke, full)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParameterError(f"parameter {name}: expected an integer{_range(min, max)}, got {_got(value)}")
        choices = list(choices) if choices is not None else None
        if choices is not None and value not in choices:
            raise ParameterError(f"parameter {name}: must be one of {', '.join(map(repr, choices))}{_why(why)}, "
                                 f"got {value!r}")
        _check_range(name, value, min, max, why=why)
        return self._keep(name, value, how)

    def float(self, name: str, value: Any, min: float | None = None, max: float | None = None,
              smoke: float | None = None, full: float | None = None, min_exclusive: bool = False,
              why: str | None = None) -> float:
        """A finite number in ``[min, max]`` (``min_exclusive``: above ``min``)."""
        value, how = self._default(name, value, smoke, full)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParameterError(f"parameter {name}: expected a number{_range(min, max, min_exclusive)}, got {_got(value)}")
        _check_range(name, value, min, max, min_exclusive, why)
        return self._keep(name, float(value), how)

    def bool(self, name: str, value: Any, smoke: bool | None = None, full: bool | None = None) -> bool:
        """``True`` or ``False``, nothing else (``-p NAME 1`` is refused: papermill reads it as an integer)."""
        value, how = self._default(name, value, smoke, full)
        if not isinstance(value, bool):
            raise ParameterError(f"parameter {name}: expected True or False, got {_got(value)}")
        return self._keep(name, value, how)

    def str(self, name: str, value: Any, choices: Iterable[str] | None = None, empty: bool = True,
            smoke: str | None = None, full: str | None = None) -> str:
        """A string, one of ``choices`` when given; ``empty=False`` refuses ``""``."""
        value, how = self._default(name, value, smoke, full)
        choices = list(choices) if choices is not None else None
        if not isinstance(value, str):
            raise ParameterError(f"parameter {name}: expected a string{_choices(choices)}, got {_got(value)}")
        if choices is not None and value not in choices:
            raise ParameterError(f"parameter {name}: {value!r} is not one of {', '.join(map(repr, choices))}")
        if not empty and not value:
            raise ParameterError(f"parameter {name}: must not be empty")
        return self._keep(name, value, how)

    def list(self, name: str, value: Any, choices: Iterable[str] | None = None, min_len: int = 1,
             smoke: Sequence | None = None, full: Sequence | None = None, contains: Iterable[str] = (),
             why: str | None = None) -> list:
        """A list of strings (each one of ``choices`` when given), at least ``min_len`` long, no repeats,
        holding every entry of ``contains``."""
        value, how = self._default(name, value, smoke, full)
        choices = list(choices) if choices is not None else None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ParameterError(f"parameter {name}: expected a list of strings{_choices(choices)}, got {_got(value)}")
        bad = [v for v in value if choices is not None and v not in choices]
        if bad:
            raise ParameterError(f"parameter {name}: {', '.join(map(repr, bad))} not among {', '.join(map(repr, choices))}")
        _check_entries(name, value, min_len)
        missing = [c for c in contains if c not in value]
        if missing:
            raise ParameterError(f"parameter {name}: must include {', '.join(map(repr, missing))}{_why(why)}, "
                                 f"got {list(value)!r}")
        return self._keep(name, list(value), how)

    def ints(self, name: str, value: Any, min: int | None = None, max: int | None = None, min_len: int = 1,
             smoke: Sequence | None = None, full: Sequence | None = None, why: str | None = None) -> list:
        """A list of integers, each in ``[min, max]``, at least ``min_len`` long, no repeats."""
        value, how = self._default(name, value, smoke, full)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ParameterError(f"parameter {name}: expected a list of integers{_range(min, max)}, got {_got(value)}")
        out = [v for v in value if (min is not None and v < min) or (max is not None and v > max)]
        if out:
            raise ParameterError(f"parameter {name}: every entry must be{_range(min, max)}{_why(why)}, "
                                 f"got {', '.join(map(repr, out))} in {list(value)!r}")
        _check_entries(name, value, min_len)
        return self._keep(name, list(value), how)

    def line(self) -> str:
        """Every checked value, marking those that came from the environment or a smoke or full-size default."""
        parts = [f"{k}={v!r}" + ("" if how == "given" else f" ({how})") for k, (v, how) in self.values.items()]
        return "parameters: " + ", ".join(parts)

    def done(self) -> None:
        """Print :meth:`line`; it returns nothing, so a notebook cell that ends with it shows the line once."""
        print(self.line())


def _range(lo, hi, lo_exclusive: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" in {'(' if lo_exclusive else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if lo_exclusive else '>='} {lo}"
    return f" <= {hi}" if hi is not None else ""


def _choices(choices) -> str:
    return f" (one of {', '.join(map(repr, choices))})" if choices else ""


def _why(why: str | None) -> str:
    return f" ({why})" if why else ""


def _check_range(name: str, value, lo, hi, lo_exclusive: bool = False, why: str | None = None) -> None:
    low = lo is not None and (value <= lo if lo_exclusive else value < lo)
    if low or (hi is not None and value > hi):
        raise ParameterError(f"parameter {name}: must be{_range(lo, hi, lo_exclusive)}{_why(why)}, got {value!r}")


def _check_entries(name: str, value: Sequence, min_len: int) -> None:
    if len(value) < min_len:
        raise ParameterError(f"parameter {name}: needs at least {min_len} entr{'y' if min_len == 1 else 'ies'}, "
                             f"got {list(value)!r}")
    if len(set(value)) != len(value):
        raise ParameterError(f"parameter {name}: repeats an entry: {list(value)!r}")


__all__ = ["ParameterError", "Parameters", "parse_smoke", "SMOKE_ENV"]
