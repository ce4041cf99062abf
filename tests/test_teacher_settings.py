"""Each teacher setting is declared once (`teacher_server.settings`): the flags, serve()'s keywords,
their defaults and checks all come from the declarations, and refusals name the setting the way
the caller spelled it. Also: the teacher_server package imports without a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_type_hints

import pytest

import teacher_server
from teacher_server.api import server_config
from teacher_server.cli import build_parser, check_flags, flag_values
from teacher_server.config import OutputSettings, ServerConfig
from teacher_server.options import CONFIG, LAUNCH, SETTINGS
from teacher_server.outputs import OutputDefaults, OutputTransform
from teacher_server.settings import settings_of
from teacher_server.spec import SpecError
from teacher_server.transforms import PARAMETERS

MODEL = "tests.models:affine"
PACKAGE = Path(__file__).resolve().parent.parent / "teacher_server"


def _flags(*extra: str) -> dict[str, object]:
    return flag_values(build_parser().parse_args(["--model", MODEL, *extra]))


def test_every_setting_is_one_flag_whose_default_is_the_keywords() -> None:
    parser = build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    values = _flags()
    for s in SETTINGS:
        assert s.option in flags, s
        if s.scope == "cli":
            continue
        want = s.launch_default
        if s.kind == "repeat":
            want = {} if s.name == "model_args" else []
        assert values[s.name] == want, (s.name, values[s.name], want)
    # serve()'s keywords are exactly the declared ones: ServerConfig's own fields among them.
    config_fields = {s.name for s in settings_of(ServerConfig)}
    assert config_fields <= set(CONFIG) and not set(CONFIG) & set(LAUNCH)
    assert {"ttl", "registry", "service", "ready_file", "threads", "malloc_tuning"} == set(LAUNCH)


def test_flags_that_differ_from_their_keyword_still_map_onto_it() -> None:
    values = _flags("--drain-grace", "4", "--no-dynamic-batching", "--model-arg", "k=[1]", "--input", "X:FP32:8")
    assert values["drain_grace_s"] == 4.0 and values["dynamic_batching"] is False
    assert values["model_args"] == {"k": [1]} and values["inputs"] == ["X:FP32:8"]
    cfg = server_config(MODEL, **{k: v for k, v in values.items() if k in CONFIG})
    assert cfg.drain_grace_s == 4.0 and not cfg.batching.enabled and cfg.model_args == {"k": [1]}


@pytest.mark.parametrize(("flag", "keyword", "value", "words"), [
    ("--top-k", "top_k", -1, "must be a non-negative integer, got -1"),  # the transform registry's words
    ("--max-batch-tokens", "max_batch_tokens", -3, "must be >= 0 (0: max-batch-size x 64), got -3"),
    ("--http-port", "http_port", 70000, "must be in 0..65535, got 70000"),
    ("--drain-grace", "drain_grace_s", -1.0, "must be >= 0 seconds, got -1.0"),
])
def test_refusals_name_the_setting_as_the_caller_spelled_it(flag: str, keyword: str, value: object,
                                                            words: str) -> None:
    with pytest.raises(SpecError) as cli:
        check_flags(build_parser().parse_args(["--model", MODEL, flag, str(value)]))
    assert str(cli.value) == f"{flag} {words}"
    with pytest.raises(SpecError) as api:
        server_config(MODEL, device="cpu", **{keyword: value})
    assert str(api.value) == f"{keyword}= {words}"


def test_batching_refusals_are_batching_configs_own_led_by_the_flag() -> None:
    with pytest.raises(SpecError) as cli:
        check_flags(build_parser().parse_args(["--model", MODEL, "--max-queue-size", "0"]))
    assert str(cli.value) == "--max-queue-size: max_queue_size must be >= 1, got 0"
    with pytest.raises(SpecError) as api:
        server_config(MODEL, device="cpu", dynamic_batching=True, max_batch_size=0)
    assert str(api.value) == "max_batch_size must be >= 1, got 0"


def test_a_config_built_directly_is_checked_by_the_same_declarations() -> None:
    with pytest.raises(SpecError, match=r"^--top-k must be a non-negative integer, got -2$"):
        ServerConfig(model=MODEL, top_k=-2)
    with pytest.raises(SpecError, match=r"^--metrics-port must be in 0\.\.65535 \(0: a free port\), got -1$"):
        ServerConfig(model=MODEL, metrics_port=-1)


def test_an_unknown_keyword_names_the_closest_setting() -> None:
    with pytest.raises(SpecError, match=r"unknown option\(s\) max_batch \(max_batch: did you mean max_batch_size\?\)"):
        server_config(MODEL, max_batch=4)
    with pytest.raises(SpecError, match="did you mean top_k"):
        server_config(MODEL, topk=4)
    with pytest.raises(SpecError, match=r"unknown option\(s\) tll \(tll: did you mean ttl\?\).*preprocess"):
        teacher_server.serve(MODEL, tll=5)  # refused before anything loads or listens


def test_the_output_transform_defaults_are_declared_in_one_place() -> None:
    """The transforms' server-wide defaults are OutputSettings' fields, and only they are the
    `outputs` group: where a registry of transforms plugs in its entries."""
    names = [s.name for s in settings_of(OutputSettings)]
    assert names == ["output_dtype", "top_k", "logprobs", "temperature", "topk_tail"]
    assert [s.name for s in SETTINGS if s.group == "outputs"] == names
    cfg = server_config(MODEL, device="cpu", top_k=3, logprobs=True, temperature=2.0)
    assert cfg.output_defaults() == OutputDefaults(None, 3, True, 2.0, False)


def test_every_transform_parameter_with_a_server_default_is_a_flag_and_a_keyword_from_the_registry() -> None:
    """A transform parameter with a server default (`Param.server_default`) is one registry entry
    and one typed field of OutputSettings: its flag and serve()'s keyword carry the registry's
    default, help text and check (in the flag's words, without the KServe field)."""
    params = [p for p in PARAMETERS.values() if p.server_default]
    declared = {s.name: s for s in settings_of(OutputSettings)}
    assert params and set(declared) == {p.name for p in params}, "one OutputSettings field per Param"
    hints = get_type_hints(OutputSettings)
    actions = {a.dest: a for a in build_parser()._actions}
    flag_defaults = _flags()
    built = server_config(MODEL, device="cpu")
    for p in params:
        s = declared[p.name]
        assert hints[p.name] in (p.type, p.type | None), (p.name, hints[p.name])
        # the flag: the registry's help text, and (for a value) its default and choices
        action = actions[s.dest]
        assert s.option in action.option_strings and s.group == "outputs"
        assert p.help.replace("%", "%%") in str(action.help), p.name
        assert flag_defaults[p.name] == p.default, p.name
        if p.choices:
            assert tuple(action.choices or ()) == p.choices
        # the keyword: serve()'s and server_config()'s, defaulting to the registry's default
        assert CONFIG[p.name] == s and s.default == p.default
        assert getattr(built, p.name) == p.default and getattr(ServerConfig(model=MODEL), p.name) == p.default
        # the check: the registry's, worded for the caller
        with pytest.raises(SpecError) as api:
            server_config(MODEL, device="cpu", **{p.name: "not-a-value"})
        assert str(api.value).startswith(f"{p.name}= must be") and p.wire not in str(api.value), str(api.value)
    assert built.output_defaults() == OutputDefaults.from_options({p.name: p.default for p in params})
    assert built.output_defaults().transform("X") == OutputTransform("X")


def _imports(path: Path) -> set[str]:
    """The teacher_server modules `path` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("teacher_server."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("teacher_server."))
    return found - {path.stem}


def test_teacher_server_modules_import_without_a_circle() -> None:
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    assert graph and "model_config" not in graph["spec"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path[path.index(name):], name))}"
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
