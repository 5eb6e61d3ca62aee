"""Advantage estimators and reward shapers that are listed but deliberately not implemented.

Their mechanism is known only from abstracts and summaries (the papers give the rules, but the stored
copies expose only the abstracts); the catalogue (``ADVANTAGES_AND_MOE.md`` §2.8, §4.5) marks the
formulas uncertain. ``stablerl list`` shows them with the reason (what was searched and what is
missing, last rechecked for issue 16), and asking for one raises an error that quotes it.
"""

from __future__ import annotations

from stablerl import UNAVAILABLE, hookimpl

UNAVAILABLE_ESTIMATORS = (
    dict(
        name="salt",
        paper="2510.20022",
        title="SALT: step-level advantage assignment via a trajectory graph (multi-turn agents)",
        notes=(
            "the step-advantage rule of arXiv 2510.20022 (EACL 2026 Findings) could not be read. Searched for issue "
            "16: the stored arXiv HTML v1, the ACL Anthology entry (bibliography only), the alphaXiv overview "
            "(stops before its 'The SALT Framework' section), arxivlens, tomesphere and deeppaper copies give the "
            "abstract or the motivation; summaries say only that identical steps of a prompt's trajectories are "
            "merged into a graph and that shared 'neutral' steps are told apart from 'decisive' ones; the paper "
            "lists no code. Missing: the step "
            "key (what makes two steps identical: the action, the observation, the whole history), how a merged "
            "step's advantage is formed (plain or weighted average of the trajectory advantages through it, or "
            "something else), whether it replaces or adds to the trajectory advantage, and the hyper-parameters. "
            "gigpo (arXiv 2505.10978), its documented relative, is offered."
        ),
    ),
)

UNAVAILABLE_SHAPERS = (
    dict(
        name="sgpo",
        paper="2505.11595",
        title="SGPO: stepwise-judge rewards that diversify all-negative groups",
        notes=(
            "the reward mapping of arXiv 2505.11595 (TMLR 2026) could not be read. Searched for issue 16: the "
            "stored arXiv abstract page (v5), mlanthology, OpenReview ALnVAqtshR, tomesphere, wizwand, summarxiv, "
            "opentrain and a gist.science explainer give the abstract or a plain-language summary that stops before "
            "the method; no code is indexed. Known: a step-wise judge scores the incorrect responses of an "
            "all-negative group so that GRPO sees different rewards there. Missing: what the judge outputs (first "
            "wrong step, count or fraction of correct steps), how that maps to a reward and on what scale next to a "
            "correct answer's, and whether groups with a correct response are left binary. It also needs a judge "
            "model's output per response, which no framework supplies."
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
