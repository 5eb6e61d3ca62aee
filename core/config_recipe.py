"""A framework's config lines (``stablerl describe``, the generated docs) declared as data, rendered once.

Every adapter shows, per algorithm, the lines that select it and set its hyper-parameters in that framework's
own spelling. Their shape is the same everywhere: lines before the selection (an import, a launcher command), the
selection (``{key}={name}``), the hyper-parameters (one line with every field, or one line per field), and notes
that apply when the algorithm declares an input, has a given name or a given hyper-parameter. A framework declares
a :class:`KindLines` per kind and gets the renderer from :func:`recipe_lines`
(``FrameworkSpec.with_config_lines(recipe_lines(spec, {...}))``).

Templates are ``str.format`` strings: ``{key}`` (the kind's selection key), ``{name}`` (the name the framework
selects the algorithm by), ``{items}`` (the fields, each written with :attr:`Params.item`, joined by
:attr:`Params.sep`) and, in per-field lines, ``{field}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from .contracts import AlgorithmSpec
from .framework_spec import FrameworkSpec
from .resolve import framework_names

#: a note's text, or a function of (spec, its hyper-parameter names) giving the text (None: no note)
NoteText = Union[str, Callable[[AlgorithmSpec, list], Optional[str]]]


@dataclass(frozen=True)
class Note:
    """A line shown when every condition given holds: the algorithm declares one of ``requires``, is ``name``, or
    has one of the hyper-parameters ``fields_any``."""

    text: NoteText
    requires: tuple = ()
    name: Optional[str] = None
    fields_any: frozenset = frozenset()

    def line(self, spec: AlgorithmSpec, fields: list) -> Optional[str]:
        if self.requires and not any(r in spec.requires for r in self.requires):
            return None
        if (self.name is not None and spec.name != self.name) or (self.fields_any and not set(fields) & self.fields_any):
            return None
        return self.text(spec, fields) if callable(self.text) else self.text


@dataclass(frozen=True)
class Params:
    """How hyper-parameters are set: ``lines`` (templates) written once with all ``{items}``, or, ``per_field``,
    once per field (a template with ``{field}``, or a function of the field name). ``only`` / ``exclude``: the
    fields this group writes."""

    lines: tuple = ()
    item: str = "{field}=<value>"
    sep: str = " "
    per_field: Optional[Union[str, Callable[[str], str]]] = None
    only: Optional[frozenset] = None
    exclude: frozenset = frozenset()

    def render(self, fields: list, **names: str) -> list:
        fields = [f for f in fields if (self.only is None or f in self.only) and f not in self.exclude]
        if not fields:
            return []
        if self.per_field is not None:
            return [self.per_field(f) if callable(self.per_field) else self.per_field.format(field=f, **names)
                    for f in fields]
        items = self.sep.join(self.item.format(field=f) for f in fields)
        return [line.format(items=items, **names) for line in self.lines]


@dataclass(frozen=True)
class KindLines:
    """The config lines of one kind: ``head`` lines, the ``select`` line, ``params_head`` (shown when the algorithm
    has hyper-parameters), each :class:`Params` group, then the :class:`Note` lines that apply."""

    head: tuple = ()
    select: str = "{key}={name}"
    params_head: tuple = ()
    params: tuple = ()
    notes: tuple = ()


def recipe_lines(framework: FrameworkSpec, recipes: dict) -> Callable[[AlgorithmSpec], list]:
    """The ``config_lines`` function of ``framework`` from its per-kind :class:`KindLines` (``"*"``: any other kind)."""

    def config_lines(spec: AlgorithmSpec) -> list:
        recipe = recipes[spec.kind] if spec.kind in recipes else recipes["*"]
        fields = list(spec.defaults())
        names = {"name": framework_names(framework, spec)[0]}
        if spec.kind in framework.selection_keys:  # a template naming {key} for a kind without one: KeyError
            names["key"] = framework.selection_keys[spec.kind]
        lines = [line.format(**names) for line in (*recipe.head, recipe.select)]
        if fields:
            lines += [line.format(**names) for line in recipe.params_head]
        for group in recipe.params:
            lines += group.render(fields, **names)
        return lines + [line for note in recipe.notes if (line := note.line(spec, fields)) is not None]

    return config_lines


__all__ = ["KindLines", "Note", "Params", "recipe_lines"]
