"""A notebook's conclusions, each a sentence built from the figures its run just measured and held to them.

A notebook's last code cell (tagged ``conclusion``) says what the run showed::

    from nvrx_lab.workbook.claims import conclude

    conclude(
        (f"the survivors went back {back} steps; in-process restart went back {ip_back}", back == 0 < ip_back),
        (f"every one of {n} rows trained once", book.exact),
    )

Every claim is printed, marked ``✓`` where the figures hold it and ``✗`` where they contradict it; then a
contradicted claim fails the cell with a :class:`ClaimError` that quotes it, so a run whose figures do not support
the lesson fails the notebook (and ``make workbook`` and ``make test``) instead of saying it.
``tests/test_notebook_claims.py`` flips a figure in a notebook's run and sees it fail.
"""

from __future__ import annotations

from collections.abc import Sequence

HELD, CONTRADICTED = "✓", "✗"


class ClaimError(AssertionError):
    """A notebook's conclusion that its own run's figures contradict."""


def conclude(*claims: tuple[str, bool], intro: str = "This run showed:") -> list[str]:
    """Print ``intro`` and each ``(sentence, holds)`` with its mark; raise :class:`ClaimError` naming every sentence
    whose ``holds`` is false. Returns the sentences (for a plot's caption or a report)."""
    if not claims:
        raise ValueError("conclude() needs at least one (sentence, holds) claim")
    for i, claim in enumerate(claims):
        if not (isinstance(claim, Sequence) and len(claim) == 2 and isinstance(claim[0], str)):
            raise TypeError(f"claim {i}: expected a (sentence, holds) pair, got {claim!r}")
    print(intro)
    for sentence, holds in claims:
        print(f"  {HELD if holds else CONTRADICTED} {sentence}")
    wrong = [sentence for sentence, holds in claims if not holds]
    if wrong:
        raise ClaimError(f"{len(wrong)} of {len(claims)} claim(s) contradicted by this run's figures: "
                         + "; ".join(wrong))
    return [sentence for sentence, _ in claims]
