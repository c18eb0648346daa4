"""Typed configuration: pydantic models loaded by pydantic-settings, written back by tomli-w.

Every process has one config model built of `Section`s; each field carries its help text and
bounds. `load_config` resolves it from these sources, each winning over the ones below it:

1. command-line flags: the few each command offers, generated from fields (`Flag`);
2. `--set key.sub=value` overrides, in order (the value is read as JSON when it parses as
   JSON, else taken as a string: `--set limits.max_n=16`, `--set 'generators=["a:1"]'`);
3. environment variables `ROLLWIRE_KEY` and `ROLLWIRE_SECTION__KEY` (`__` nests; a whole
   section or a list as JSON; `null` is None), e.g. `ROLLWIRE_LIMITS__MAX_N=16`;
4. the file given with `--config` (TOML; the learner also reads YAML);
5. the fields' defaults.

Unknown keys are errors that name the key, in a file, an override or a section's environment
variable; only an environment variable naming no top-level key is ignored, so one environment
can hold settings for several processes. `dump_config` writes TOML that loads back to the
same config (`--dry-run`). This module is the only reader of the environment for config.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
import json
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from rollwire.runtime.flags import Flag
from rollwire.runtime.registry import Registry

T = TypeVar("T", bound=BaseModel)

ENV_PREFIX = "ROLLWIRE_"
ENV_NESTING = "__"


class Section(BaseModel):
    """Base for config sections: unknown keys are refused, assignment is validated.

    A field's help is the docstring under it, the same habit as the dataclasses elsewhere; it
    becomes the field's description (unless `Field(description=...)` gives one), with its line
    breaks folded, which --help, the docs and error messages read. `attribute_docstrings`
    reads them once per module; pydantic's `use_attribute_docstrings` reads the same ones but
    re-reads and re-parses the source for each class, which cost every rollwire process and
    `rollwire --help` ~0.3 s of start-up (issue 33)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    renamed_keys: ClassVar[dict[str, str]] = {}
    """Old key -> its new name in this section: a config that still sets the old key is refused with the new one."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        docs = attribute_docstrings(cls)
        for name, info in cls.model_fields.items():
            if info.description is None and name in docs:
                info.description = docs[name]
            if info.description:
                info.description = " ".join(info.description.split())


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Attribute name -> the docstring under it in `cls`'s own body (an annotated assignment
    followed by a string statement), cleaned as `inspect.cleandoc` does; {} without source."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if path and "<locals>" not in cls.__qualname__:
        return _module_docstrings(path).get(cls.__qualname__, {})
    try:  # a class defined in a function: read its own source
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = tree.body[0] if tree.body else None
    return _class_docstrings(node) if isinstance(node, ast.ClassDef) else {}


@functools.cache
def _module_docstrings(path: str) -> dict[str, dict[str, str]]:
    """Every class of the module at `path` (nested ones by their qualified name) -> its
    attribute docstrings; the file is parsed once, however many classes it defines."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    found: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = _class_docstrings(node)
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return found


def _class_docstrings(node: ast.ClassDef) -> dict[str, str]:
    docs: dict[str, str] = {}
    for before, after in itertools.pairwise(node.body):
        if (
            isinstance(before, ast.AnnAssign)
            and isinstance(before.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[before.target.id] = inspect.cleandoc(after.value.value)
    return docs


class ConfigError(ValueError):
    """A config file, override or variable that cannot be used; the message names the key."""


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[str, object]:
    """`a.b=3` -> ("a.b", 3): the value is JSON when it parses as JSON, else the string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def load_config(
    model: type[T],
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    flags: Mapping[str, object] | None = None,
) -> T:
    """`model` from flags > `overrides` > environment > file `path` > defaults (module docstring).

    `flags` maps dotted keys to values; None means "flag not given" and is skipped.
    Raises ConfigError naming the offending key.
    """
    from pydantic_settings import SettingsError

    explicit = [parse_override(o) for o in overrides]
    explicit += [(key, value) for key, value in (flags or {}).items() if value is not None]
    loader = _loader(model, _file_source(path) if path else None)
    try:
        loaded = loader(**_nest(explicit))
    except ValidationError as exc:
        problems = "; ".join(_problem(model, e) for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None
    except SettingsError as exc:  # e.g. an environment variable that should hold JSON
        raise ConfigError(f"invalid configuration: {exc}") from None
    except _FileError as exc:
        raise ConfigError(str(exc)) from None
    # Hand back the plain model (not the loader subclass), built from the values just validated.
    values = {name: getattr(loaded, name) for name in model.model_fields}
    return model.model_construct(_fields_set=set(loaded.model_fields_set), **values)


def _problem(model: type[BaseModel], error: Any) -> str:
    """`key: message`, where a key a section has renamed (Section.renamed_keys) names its new key."""
    key = ".".join(str(p) for p in error["loc"])
    section: Any = model
    for part in error["loc"][:-1]:
        info = getattr(section, "model_fields", {}).get(part)
        section = info.annotation if info is not None else None
    new = getattr(section, "renamed_keys", {}).get(error["loc"][-1]) if error["type"] == "extra_forbidden" else None
    if new:
        return f"{key} is now {'.'.join([*map(str, error['loc'][:-1]), new])}: rename it"
    return f"{key}: {error['msg']}"


def _nest(items: Iterable[tuple[str, object]]) -> dict:
    """Dotted (key, value) pairs -> nested dicts; a later pair wins over an earlier one."""
    data: dict = {}
    for dotted, value in items:
        keys = dotted.split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: {key} is not a section")
        node[keys[-1]] = value
    return data


class _FileError(Exception):
    """The config file does not parse (or holds no mapping); the message names the file."""


def _file_source(path: str | Path):
    """A factory of the pydantic-settings source that reads `path` (TOML, or YAML by suffix)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: YAML configs need PyYAML (pip install pyyaml), or use TOML") from None
        from pydantic_settings import YamlConfigSettingsSource

        def yaml_source(settings_cls):
            try:
                return YamlConfigSettingsSource(settings_cls, yaml_file=path)
            except yaml.YAMLError as exc:
                raise _FileError(f"config file {path} is not valid YAML: {exc}") from None
            except (TypeError, ValueError):  # the source merges the document into a dict
                raise _FileError(f"config file {path} must hold a mapping of keys") from None

        return yaml_source

    import tomllib

    from pydantic_settings import TomlConfigSettingsSource

    def toml_source(settings_cls):
        try:
            return TomlConfigSettingsSource(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as exc:
            raise _FileError(f"config file {path} is not valid TOML: {exc}") from None

    return toml_source


def _loader(model: type[T], file_source) -> Any:
    """A pydantic-settings class over `model` whose sources are explicit values, the
    environment and the file, in that order of precedence (the pattern pydantic-settings'
    own CliApp uses to load a plain model). Built per call: the file is part of the class."""
    from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

    class Loader(BaseSettings, model):  # type: ignore[misc, valid-type]
        model_config = SettingsConfigDict(extra="forbid", case_sensitive=True)

        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            environment = EnvSettingsSource(
                settings_cls,
                case_sensitive=False,
                env_prefix=ENV_PREFIX,
                env_nested_delimiter=ENV_NESTING,
                env_parse_none_str="null",
            )
            sources = [init_settings, environment]
            if file_source is not None:
                sources.append(file_source(settings_cls))
            return tuple(sources)

    Loader.__name__ = Loader.__qualname__ = model.__name__
    return Loader


# ---------------------------------------------------------------- writing


def dump_config(config: BaseModel) -> str:
    """The resolved configuration as TOML that `load_config` reads back to an equal config.

    None values are left out (TOML has no null): every optional key defaults to None.
    """
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


# ---------------------------------------------------------------- command line


def add_config_arguments(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    flags: Sequence[Flag | str] = (),
    *,
    example: str,
    file_help: str = "TOML file of config keys",
) -> None:
    """--config, --set, --dry-run, and a flag per `flags` entry generated from `model`'s fields."""
    parser.add_argument("--config", metavar="FILE", help=file_help)
    parser.add_argument(
        "--set",
        dest="set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config key (repeatable), e.g. {example}; flags > --set > ROLLWIRE_* environment > --config file > defaults",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config as TOML and exit")
    specs = [Flag(f) if isinstance(f, str) else f for f in flags]
    if not specs:
        return
    group = parser.add_argument_group("config keys", "Each flag sets the config key named in its help.")
    for spec in specs:
        group.add_argument(spec.flag, dest=spec.dest, default=None, **_flag_kwargs(model, spec))
    parser.set_defaults(config_flags=tuple(spec.key for spec in specs))


def add_process_command(
    subparsers: Any,
    name: str,
    model: type[BaseModel],
    flags: Sequence[Flag | str] = (),
    *,
    example: str,
    help: str | None = None,
    description: str | None = None,
    file_help: str = "TOML file of config keys",
) -> argparse.ArgumentParser:
    """`rollwire NAME`, a long-running process configured by `model`: its config arguments
    (add_config_arguments) and --ready-file; the caller adds its own and sets `func`. The help
    line and the description default to the model's docstring, which says what the process is."""
    about = " ".join((model.__doc__ or name).split())
    p = subparsers.add_parser(name, help=help or about, description=description or about)
    add_config_arguments(p, model, flags, example=example, file_help=file_help)
    p.add_argument("--ready-file", help="write {port, metrics_port, pid} as JSON here once serving")
    return p


def config_for_command(model: type[T], args: argparse.Namespace, overrides: Sequence[str] = ()) -> T | int:
    """The config a command's arguments resolve to (flags > `overrides` and --set > env > file),
    or the exit code when the command ends here: 2 after printing the error to stderr, 0 after
    --dry-run printed the config as TOML."""
    try:
        config = load_config(model, args.config, [*overrides, *args.set], flag_values(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_config(config), end="")
        return 0
    return config


def flag_values(args: argparse.Namespace) -> dict[str, object]:
    """Dotted key -> value of the config flags given on this command line."""
    values = {key: getattr(args, Flag(key).dest) for key in getattr(args, "config_flags", ())}
    return {key: value for key, value in values.items() if value is not None}


def field_info(model: type[BaseModel], key: str) -> FieldInfo:
    """The field at dotted `key` of `model`."""
    *sections, name = key.split(".")
    for section in sections:
        annotation = model.model_fields[section].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), key
        model = annotation
    return model.model_fields[name]


def _flag_kwargs(model: type[BaseModel], spec: Flag) -> dict[str, Any]:
    info = field_info(model, spec.key)
    kind: Any = info.annotation
    kwargs: dict[str, Any] = {}
    if get_origin(kind) is list:
        (kind,) = get_args(kind)
        kwargs["action"] = "append"
    if kind not in (str, int, float):
        raise TypeError(f"{spec.key}: a flag can set a str, int or float key (or a list of one), not {kind}")
    kwargs["type"] = kind
    registry = next((m for m in info.metadata if isinstance(m, Registry)), None)
    if registry is not None:
        kwargs["choices"] = registry.names()  # argparse shows them in place of a metavar
    else:
        kwargs["metavar"] = spec.metavar or spec.key.rsplit(".", 1)[-1].upper()
    help_text = (info.description or "").replace("%", "%%")
    default = info.get_default(call_default_factory=True)
    shown = f"; default {default}" if default not in ("", None, []) else ""
    kwargs["help"] = f"{help_text} [{spec.key}{shown}]"
    return kwargs
