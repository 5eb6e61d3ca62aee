"""Advantage estimators and reward shapers that are listed but deliberately not implemented.

Their mechanism is known only from abstracts and summaries (the papers give the rules, but the stored
copies expose only the abstracts); the catalogue (``ADVANTAGES_AND_MOE.md`` §2.8, §4.5) marks the
formulas uncertain. ``stablerl list`` shows
them with the reason, and asking for one raises an error that quotes it.
"""

from __future__ import annotations

from stablerl import UNAVAILABLE, hookimpl

UNAVAILABLE_ESTIMATORS = (
    dict(
        name="salt",
        paper="2510.20022",
        title="SALT: step-level advantage assignment via a trajectory graph (multi-turn agents)",
        notes=(
            "only the mechanism of arXiv 2510.20022 is known (merge identical steps of a prompt's trajectories "
            "into a graph, give each merged step the average trajectory advantage of the trajectories through "
            "it); the paper gives the rule, but every stored copy of it (arXiv HTML v1, the EACL 2026 entry, "
            "summaries) exposes only the abstract, so the merge criterion, the step key and whether the average is "
            "weighted could not be read, and no code was found (rechecked for issue 16). gigpo (arXiv 2505.10978), "
            "its better-documented relative, is offered."
        ),
    ),
)

UNAVAILABLE_SHAPERS = (
    dict(
        name="sgpo",
        paper="2505.11595",
        title="SGPO: stepwise-judge rewards that diversify all-negative groups",
        notes=(
            "the mapping from the step-wise judge's output (first wrong step / number of correct steps) to the "
            "reward of an incorrect response in an all-negative group is in the paper (arXiv 2505.11595, TMLR "
            "2026), but every stored copy of it exposes only the abstract, and no code was found (rechecked for "
            "issue 16); it also needs a judge model's outputs per response."
        ),
    ),
)


@hookimpl
def register_advantage_estimators(register):
    for entry in UNAVAILABLE_ESTIMATORS:
        register(fn=None, status=UNAVAILABLE, **entry)


@hookimpl
def register_reward_shapers(register):
    for entry in UNAVAILABLE_SHAPERS:
        register(fn=None, status=UNAVAILABLE, **entry)
