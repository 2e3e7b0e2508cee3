"""Typed Hydra configs shared by every job: compose a packaged config like its entry point would, and merge a
composed config into its dataclass schema so an unknown key or a wrong type fails with a ValueError naming it.

Schemas themselves live with their stage (deepspec/training/config.py, deepspec/cache/config.py, the
drafter kinds' params/loss classes); the YAML files under deepspec/conf are deltas over them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from deepspec.utils.errors import UsageError

CONFIG_MODULE = "deepspec.conf"  # the packaged Hydra configs


def register_resolvers() -> None:
    """`${deepspec.or:a,b}`: a unless it is null, else b (oc.select returns a null as is). Idempotent."""
    if not OmegaConf.has_resolver("deepspec.or"):
        OmegaConf.register_new_resolver("deepspec.or", lambda value, default: default if value is None else value)


def config_options(group: str) -> list[str]:
    """The options of a packaged config group (deepspec/conf/<group>/<option>.yaml), e.g. the experiments."""
    from importlib.resources import files

    folder = files(CONFIG_MODULE) / group
    return sorted(item.name.removesuffix(".yaml") for item in folder.iterdir() if item.name.endswith(".yaml"))


def compose_config(config_name: str, overrides=(), config_dir: str | Path | None = None, what: str = "config"
                   ) -> DictConfig:
    """Compose `config_name` with Hydra's compose API (tests, the pipeline), as its `@hydra.main` would.

    The Hydra runtime config is set too, so `${hydra:runtime.choices.<group>}` interpolations resolve.
    `config_dir` replaces the packaged configs (deepspec/conf) with a folder of the same layout. Register the
    schemas in Hydra's ConfigStore first.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import ConfigCompositionException, MissingConfigException

    from deepspec.utils.hydra_command import missing_config_line

    register_resolvers()
    context = (initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3") if config_dir
               else initialize_config_module(CONFIG_MODULE, version_base="1.3"))
    with context:
        try:
            cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        except MissingConfigException as e:  # `drafter=dsprk`: the choices, not Hydra's search path
            raise UsageError(f"invalid {what}: {missing_config_line(e, list(overrides))}") from None
        except ConfigCompositionException as e:  # an unknown key or a wrong type, named by Hydra
            raise UsageError(f"invalid {what}: {e}") from None
    HydraConfig.instance().set_config(cfg)
    return cfg


def merge_into_schema(cfg, schema_for: Callable[[DictConfig], DictConfig], what: str = "config"):
    """`cfg` (a composed DictConfig, with or without Hydra's runtime node, or a plain dict) merged into the
    structured schema `schema_for(user_config)` returns, as the dataclass objects (struct mode)."""
    if isinstance(cfg, DictConfig):  # only the job's keys count, not Hydra's runtime node
        cfg = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    user = OmegaConf.create(cfg)
    user.pop("hydra", None)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema_for(user), user))
    except ValueError as e:
        if str(e).startswith(f"invalid {what}"):
            raise UsageError(str(e)) from None
        raise UsageError(f"invalid {what}: {e}") from None
    except Exception as e:  # omegaconf's ConfigKeyError/ValidationError carry the full key
        key = getattr(e, "full_key", None)
        raise UsageError(f"invalid {what}: {key + ': ' if key else ''}{str(e).splitlines()[0]}") from None
