"""Hook specifications: what a Quire plugin may implement.

A plugin is any object (usually a module) exposed through the ``quire.platforms`` entry
point group whose functions carry ``@hookimpl``. Only functions marked with the
``hookimpl`` below count; names alone do not.
"""

from __future__ import annotations

import pluggy

from quire.plugins.spec import ModelSpec, PlatformSpec

#: Marks the specifications below. Project name "quire".
hookspec = pluggy.HookspecMarker("quire")
#: Plugins mark their implementations with this.
hookimpl = pluggy.HookimplMarker("quire")


@hookspec
def quire_platforms() -> list[PlatformSpec]:
    """Return the platforms this plugin provides.

    Called once per registry, at discovery. Must be cheap and must not import vendor
    libraries: each :class:`~quire.plugins.spec.PlatformSpec` carries a factory that the
    registry calls only to list, probe or use the platform.

    :returns: one spec per platform; an empty list (or ``None``) means this plugin adds no
        platform.
    """


@hookspec
def quire_model_architectures() -> list[ModelSpec]:
    """Return model implementations this plugin adds, keyed by Hugging Face architecture.

    The core's own architectures come first; a plugin may not replace one (the registry
    raises naming both providers).

    :returns: one spec per architecture; an empty list (or ``None``) adds nothing.
    """
