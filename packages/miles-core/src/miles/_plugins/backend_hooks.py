"""What a training backend calls inside its rank processes, so every backend gives hooks one meaning.

* :func:`configure_process`: a rank process starts with a fresh plugin manager, so the
  driver's ``miles_configure`` never reached its plugins. The driver sends the validated
  config as JSON data (``BackendSpec.config``); this rebuilds the same typed config
  (plugin sections included) and fires ``miles_configure`` with it.
* :func:`apply_loss_hooks`: the loss of one micro-batch through ``miles_loss_terms``
  (summed, each logged) and then the ``miles_loss_postprocess`` chain.

torch is imported only when a loss hook actually runs, so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from miles.errors import ComponentError, ConfigError

if TYPE_CHECKING:
    from miles.config.schema import MilesConfig
    from miles.interfaces import LossInputs, LossOutput


def configure_process(config_data: Mapping[str, Any] | None, pm: pluggy.PluginManager) -> MilesConfig | None:
    """Validate ``config_data`` with ``pm``'s plugin sections and fire ``miles_configure`` with it.

    ``None`` (a backend driven directly, without a run config) configures nothing. The data
    validated in the driver, so a failure here means the rank's plugins differ from the
    driver's (e.g. another environment on a Ray node): say so rather than guess.
    """
    if config_data is None:
        return None
    from pydantic import ValidationError

    from miles.config.loader import plugin_config_model

    model = plugin_config_model(pm)
    try:
        config = model.model_validate(dict(config_data))
    except ValidationError as exc:
        raise ConfigError(
            "the run config sent to this trainer rank does not validate here, so its plugins differ "
            f"from the driver's (install the same plugins where the ranks run): {exc}"
        ) from exc
    pm.hook.miles_configure.call_historic(kwargs={"config": config})
    return config


def apply_loss_hooks(
    pm: pluggy.PluginManager, output: LossOutput, inputs: LossInputs, kind: str
) -> LossOutput:
    """``output`` plus every plugin's ``miles_loss_terms``, then through the ``miles_loss_postprocess`` chain."""
    output = _add_terms(pm, output, inputs, kind)
    return _postprocess_chain(pm, output, inputs, kind)


def _add_terms(pm: pluggy.PluginManager, output: LossOutput, inputs: LossInputs, kind: str) -> LossOutput:
    from miles.interfaces import LossOutput

    loss = output.loss
    metrics = dict(output.metrics)
    owners: dict[str, str] = {}
    # One implementation at a time (not one pluggy call) so that an error can name the plugin.
    for who, terms in _each(pm.hook.miles_loss_terms, {"inputs": inputs, "kind": kind}):
        if terms is None:
            continue
        if not isinstance(terms, Mapping):
            raise ComponentError(
                f"plugin {who!r} returned {type(terms).__name__} from miles_loss_terms; expected {{name: tensor}}"
            )
        import torch

        for name, term in terms.items():
            if not (isinstance(term, torch.Tensor) and term.dim() == 0):
                raise ComponentError(
                    f"plugin {who!r}: loss term {name!r} must be a scalar tensor, got "
                    f"{type(term).__name__} of shape {tuple(getattr(term, 'shape', ()))}"
                )
            if name in owners or name in metrics:
                first = f"plugin {owners[name]!r}" if name in owners else "the loss itself"
                raise ComponentError(
                    f"loss term {name!r} of plugin {who!r} is already logged by {first}; "
                    "each term needs a name of its own"
                )
            owners[name] = who
            loss = loss + term
            metrics[name] = float(term.detach())
    if not owners:
        return output
    return LossOutput(loss=loss, metrics=metrics)


def _postprocess_chain(
    pm: pluggy.PluginManager, output: LossOutput, inputs: LossInputs, kind: str
) -> LossOutput:
    from miles.interfaces import LossOutput

    offered: dict[str, Any] = {"output": output, "inputs": inputs, "kind": kind}
    for who, result in _each(pm.hook.miles_loss_postprocess, offered):
        if result is None:
            # Kept, possibly mutated in place; the next implementation sees the same object.
            continue
        if not isinstance(result, LossOutput):
            raise ComponentError(
                f"plugin {who!r} returned {type(result).__name__} from miles_loss_postprocess; "
                "expected a LossOutput or None"
            )
        offered["output"] = output = result
    return output


def _each(hook: pluggy.HookCaller, offered: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Call ``hook``'s implementations one by one, in pluggy's order, each with the arguments it asks for.

    ``offered`` is read at each call, so a caller that updates it between calls chains them.
    """
    impls = hook.get_hookimpls()
    wrappers = [i.plugin_name for i in impls if i.wrapper or i.hookwrapper]
    if wrappers:
        raise ComponentError(
            f"plugin(s) {wrappers} wrap {hook.name}; its implementations are called one by one, so "
            "there is no single call to wrap: implement it as a plain hook"
        )
    # get_hookimpls() lists implementations in the reverse of the order pluggy calls them.
    for impl in reversed(impls):
        yield impl.plugin_name, impl.function(*(offered[name] for name in impl.argnames))
