"""A command's options class to command-line flags and back: argparse flags with MeZO's and HF's names (underscore
and hyphen spellings, aliases, help in one section per option group), YAML config files (checked key by key, paths
relative to the file; TRL's config names too, trl_names.py), and the run's config.yaml."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from xgblora import atomic, outputs, trl_names
from xgblora.checks import field_default
from xgblora.config import Config, check_ignored, defaults_elsewhere, groups_of, own_options
from xgblora.errors import UserError


def parse_bool(text: str | bool) -> bool:
    """Parse a boolean flag value the way HF's argument parser does (true/false, yes/no, 1/0)."""
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("true", "yes", "y", "1", "on"):
        return True
    if lowered in ("false", "no", "n", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The class's resolved annotations, once per class: resolving them per field is most of a parser's build time
    (5 s for every command's flags, against 0.1 s)."""
    return typing.get_type_hints(cls)


def _field_type(cls: type, f: dataclasses.Field) -> tuple[type, bool, bool]:
    """(base type, optional, is_list) of a dataclass field."""
    hint = _type_hints(cls)[f.name]
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


def _converter(base: type, optional: bool):
    convert = parse_bool if base is bool else base

    def parse(text: str):
        if optional and isinstance(text, str) and text.strip().lower() in ("none", "null"):
            return None
        return convert(text)

    parse.__name__ = base.__name__  # argparse names the type in its error messages
    return parse


def _aliases(f: dataclasses.Field) -> tuple[str, ...]:
    """A field's other names (MeZO's, the fork's or TRL's spellings of the option)."""
    return tuple(f.metadata.get("aliases", ()))


def add_arguments(parser: argparse.ArgumentParser, cls: type, defaults: dict[str, Any] | None = None) -> None:
    """Add one flag per field of cls: a help section for the command's own options, then one per option group it
    inherits (config.groups_of). Each flag in underscore and hyphen spelling plus aliases; defaults are suppressed
    (the help shows the command's own: `defaults` first, then the dataclass's)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    own = own_options(cls)
    sections = [(f"{cls.__name__.removesuffix('Config') or 'these'} options", None, own)] * bool(own) + [
        (f"{group.__name__.removesuffix('Options')} options", group.__doc__,
         [f.name for f in dataclasses.fields(group) if f.name not in own]) for group in groups_of(cls)]
    for title, description, names in sections:
        target = parser.add_argument_group(title, description)
        for name in names:
            _add_flag(target, cls, fields[name], (defaults or {}).get(name, field_default(fields[name])))
    parser.add_argument("--config", dest="config", default=argparse.SUPPRESS, metavar="FILE.yaml",
                        help="Read options from a YAML file; flags on the command line win.")


def _add_flag(parser: Any, cls: type, f: dataclasses.Field, default: Any) -> None:
    base, optional, is_list = _field_type(cls, f)
    names = {f"--{f.name}", f"--{f.name.replace('_', '-')}"}
    for alias in _aliases(f):
        names |= {f"--{alias}", f"--{alias.replace('_', '-')}"}
    text = f.metadata.get("help", "")
    if default is not None or "default" not in text.lower():  # else the help says what unset means
        text += f" (default: {'unset' if default is None else default})"
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
    if base is bool:
        kwargs.update(nargs="?", const=True, type=_converter(bool, optional), metavar="BOOL")
    elif is_list:
        kwargs.update(nargs="+", type=base)
    else:
        kwargs.update(type=_converter(base, optional))
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
    parser.add_argument(*sorted(names, key=lambda n: ("-" in n[2:], n)), **kwargs)


def _check_yaml_value(cls: type, f: dataclasses.Field, value: Any, path: str) -> Any:
    base, optional, is_list = _field_type(cls, f)
    where = f"{path}: key {f.name!r}"
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}: expected {base.__name__}, got null")
    items = value if isinstance(value, list) and is_list else [value]
    accepted = {bool: (bool,), float: (int, float), int: (int,), str: (str,)}[base]
    out = []
    for item in items:
        if not isinstance(item, accepted) or (isinstance(item, bool) and base is not bool):  # YAML true is no int
            raise UserError(f"{where}: expected {base.__name__}, got {type(item).__name__} {item!r}")
        choices = f.metadata.get("choices")
        if choices and item not in choices:
            raise UserError(f"{where}: {item!r} is not one of {', '.join(choices)}")
        out.append(float(item) if base is float else item)
    return out if is_list else out[0]


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML does not allow it, and PyYAML would
    keep the last value without a word (a config that sets learning_rate twice runs with the second)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice, first on line {seen[key]}; keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(cls: type, path: str, command: str = "") -> dict[str, Any]:
    """Read a YAML config into validated field values; unknown keys get the closest valid key suggested. Another
    command's option (a config.yaml that command wrote) passes at a default it has there and is left out; at any
    other value it is refused, naming `command`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read config file ({exc.__class__.__name__}: {exc})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeys) or {}  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of option: value, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = {a: f.name for f in fields.values() for a in _aliases(f)}
    trl = trl_names.table_for(cls)
    values: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    from_trl: dict[str, tuple[str, Any]] = {}  # option -> (the TRL key that set it, its value)
    for key, value in data.items():
        raw = str(key).replace("-", "_")
        name = aliases.get(raw, raw)
        entry = trl.get(raw)
        if entry is not None and (name not in fields or isinstance(entry, trl_names.Mapped)):
            for option, converted in trl_names.resolve(entry, str(key), value, path).items():
                _set_once(from_trl, option, (str(key), converted), path)
        elif name not in fields and not defaults_elsewhere(name):
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{path}: unknown key {key!r}{hint}")
        elif name not in fields:
            _check_foreign(name, value, command)
        else:
            if name in keys:  # two spellings of one option (hyphen, alias): the last would win as a repeated key does
                raise UserError(f"{path}: keys {keys[name]!r} and {key!r} both set {name}; keep one")
            keys[name] = key
            values[name] = _check_yaml_value(cls, fields[name], value, path)
    for option, (key, value) in from_trl.items():
        if option not in fields:
            _check_foreign(option, value, command)
            continue
        value = _check_yaml_value(cls, fields[option], value, path)
        if option in values and values[option] != value:
            raise UserError(f"{path}: key {key!r} (TRL's) sets {option} to {value!r}, key {option!r} to "
                            f"{values[option]!r}; keep one of them")
        values[option] = value
    return {k: _beside(Path(path).parent, v) if k in INPUT_PATHS and isinstance(v, str) else v
            for k, v in values.items()}


def _check_foreign(name: str, value: Any, command: str) -> None:
    """Another command's option in a YAML config: it passes at a default it has there (a config.yaml that command
    wrote names every option of its own); at any other value the run would not read it, a one-line UserError."""
    if value not in defaults_elsewhere(name):
        raise UserError(f"--{name} {value!r} does nothing here: xgblora {command} never reads it")


def _set_once(chosen: dict[str, tuple[str, Any]], option: str, setting: tuple[str, Any], path: str) -> None:
    """Record a TRL key's value of an xgblora option; two TRL keys that set it differently are an error."""
    if option in chosen and chosen[option][1] != setting[1]:
        raise UserError(f"{path}: keys {chosen[option][0]!r} and {setting[0]!r} (TRL's) set {option} to "
                        f"{chosen[option][1]!r} and {setting[1]!r}; keep one of them")
    chosen[option] = setting


# Options naming files or folders a run reads: in a YAML config they are relative to the config's own folder
# (outputs stay relative to where the command runs).
INPUT_PATHS = ("train_file", "eval_file", "grit_train_file", "chat_template", "data_dir", "input_file", "adapter",
               "model_name", "sampler_model", "resume_from_checkpoint", "beir_dir", "corpus_file", "queries_file",
               "qrels_file", "reranker")


def _beside(folder: Path, value: str) -> str:
    """A relative path in a YAML config, read from the config's folder: when it exists there or is written as a
    path (./x, ../x); anything else (a hub id, a built-in model, 'latest') is left as it is."""
    if Path(value).is_absolute() or value.startswith(("~", "pkg:")):
        return value
    candidate = folder / value
    return str(candidate) if candidate.exists() or value.startswith(("./", "../")) else value


def from_namespace(cls: type, ns: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Any:
    """Build a command's options from parsed flags: defaults (the command's own first), then --config FILE, then the
    command line; options the run would never read are refused (config.check_ignored)."""
    command = getattr(ns, "command", "")
    given = {k: v for k, v in vars(ns).items() if k in {f.name for f in dataclasses.fields(cls)}}
    values = dict(defaults or {})
    values.update(read_yaml(cls, ns.config, command) if getattr(ns, "config", None) else {})
    values.update(given)
    cfg = cls(**values)
    check_ignored(cfg, defaults)
    if getattr(ns, "config", None) and hasattr(cfg, "output_dir"):
        outputs.check_config_file(Path(cfg.output_dir), ns.config)
    return cfg


def dump(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (every option, so the run can be repeated with --config), under the header
    that marks it as the run's own."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    atomic.write_text(path, f"{outputs.CONFIG_HEADER}\n{text}")
