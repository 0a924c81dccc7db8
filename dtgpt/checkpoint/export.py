"""Whole checkpoints in one process: read any checkpoint as full tensors, write one from tensors,
and convert to and from a Hugging Face directory (GPT-2, Llama or DeepSeek-V3: gpt2.py,
hf_llama.py, hf_deepseek.py).

Used by scripts/convert_checkpoint.py and scripts/generate.py. DCP reassembles the shards of
whatever mesh saved the checkpoint into full tensors here, so nothing needs a process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dtgpt.checkpoint import gpt2, hf_checks, hf_deepseek, hf_files, hf_llama, hf_tokenizer, layout
from dtgpt.checkpoint.hf_files import HFLayout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.safe import SafeReader, load_problem
from dtgpt.checkpoint.saved_config import as_saved, read_saved_config
from dtgpt.checkpoint.stored import extra_problem, flat_keys, shape_problem
from dtgpt.config import Config, DataConfig, ModelConfig, config_from_dict, load_config, to_toml, validate
from dtgpt.data.tokenizer import build_tokenizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from dtgpt.config import padded_vocab_size
from dtgpt.model import GPT, OUTPUT_WEIGHT, WORD_EMBEDDING

TORCH_FORMAT = "dtgpt-torch-1"


def find_checkpoint(path: str | Path, iteration: int = 0) -> Path:
    """An iteration directory: `path` itself when it is one, else the one its pointer names
    (or `iteration`), with the usual fallback to the newest complete one."""
    path = Path(path)
    from dtgpt.checkpoint.megatron.formats import find as find_megatron  # here: that package imports this module

    megatron_dir = find_megatron(path, iteration)
    if megatron_dir is not None:
        raise CheckpointError(
            f"{path} is a Megatron-LM checkpoint ({megatron_dir.name}), not a dtgpt one: this tool reads dtgpt checkpoints; "
            f"convert it first (convert_checkpoint.py from-megatron {path} NEW_DIR --config run.toml), or load it in "
            "train.py with checkpoint.load"
        )
    if (path / layout.DCP_METADATA).is_file() and iteration == 0:
        why = layout.problem(path)
        if why is not None:
            raise CheckpointError(f"{path} is not a complete checkpoint: {why}")
        return path
    found = layout.resolve(str(path), iteration, fresh_ok=False, fix="give a checkpoint.save directory of a run, or one of its iter_* directories")
    for warning in found.warnings:
        print(f"WARNING: {warning}")
    return found.directory


def read_config(directory: Path, config_path: str | None = None) -> Config:
    """The config stored with the checkpoint, or `config_path` when given."""
    path = Path(config_path) if config_path else directory / layout.CONFIG
    if config_path and not path.is_file():
        raise CheckpointError(f"--config={config_path}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {layout.CONFIG}; pass the run's config explicitly")
    return load_config(path) if config_path else read_saved_config(path)


def read_sections(directory: Path, sections: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Every stored tensor of the chosen sections (all when None), full size:
    {"model": {fqn: tensor}, "optimizer": {"state.<fqn>.exp_avg": tensor}, "train_state": {...}}.
    A checkpoint holding anything but tensors is refused (layout.read_metadata)."""
    metadata = layout.read_metadata(directory)
    flat: dict[str, object] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if sections is None or key.split(".", 1)[0] in sections:
            flat[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    with layout.single_process():
        dcp.load(flat, checkpoint_id=str(directory), storage_reader=SafeReader(directory), no_dist=True)
    nested: dict[str, dict] = {}
    for key, value in flat.items():
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    return nested


def model_vocab_size(directory: Path) -> int:
    """The padded vocabulary the checkpoint was trained with (rows of the word embedding)."""
    entry = layout.read_metadata(directory).state_dict_metadata.get(f"model.{WORD_EMBEDDING}")
    if entry is None:
        raise CheckpointError(f"{directory} has no model.{WORD_EMBEDDING}")
    return int(entry.size[0])


def load_model(directory: Path, cfg: Config) -> GPT:
    """A plain one-device GPT with the checkpoint's weights (tied head filled from the embedding)."""
    model = GPT(cfg.model, model_vocab_size(directory))
    state = {k: v for k, v in model.state_dict().items() if not (model.tied and k == OUTPUT_WEIGHT)}
    metadata = layout.read_metadata(directory)
    request = flat_keys("model", state)
    problem = shape_problem(request, metadata, "model") or extra_problem(set(request), metadata)
    if problem:
        raise CheckpointError(f"checkpoint {directory} does not fit the config's model: {problem}")
    with layout.single_process():
        dcp.load({"model": state}, checkpoint_id=str(directory), storage_reader=SafeReader(directory), no_dist=True)
    model.load_state_dict(state, strict=False)  # state aliases the parameters; this is a no-op copy
    return model


def write_checkpoint(
    root: str | Path, iteration: int, sections: dict[str, dict], cfg: Config, source: str, mesh: dict | None = None,
    checked: bool = False,
) -> Path:
    """Write `sections` as a complete DCP checkpoint under root (directory, config, marker, pointer);
    `checked`: the caller has refused an existing checkpoint there already (and may have put
    files into the directory since)."""
    directory = layout.iteration_dir(root, iteration)
    if not checked:
        _refuse_existing(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {directory}: {e.strerror}") from None
    model = sections.get("model", {})
    tied = not cfg.model.untie_embeddings_and_output_weights
    if tied and OUTPUT_WEIGHT in model:  # stored once, as training stores it
        model = {k: v for k, v in model.items() if k != OUTPUT_WEIGHT}
        sections = {**sections, "model": model}
    with layout.single_process():
        dcp.save(sections, checkpoint_id=str(directory), no_dist=True)
    layout.write_atomic(directory / layout.CONFIG, to_toml(cfg))
    consumed = int(sections.get("train_state", {}).get("consumed_samples", 0))
    layout.write_marker(directory, {
        "format": layout.FORMAT, "iteration": iteration, "consumed_samples": consumed, "mesh": mesh,
        "tied": tied, "time": time.time(), "converted_from": source,
    })  # fmt: skip
    layout.write_pointer(root, iteration)
    return directory


def _refuse_existing(directory: Path) -> None:
    """A conversion never replaces a checkpoint, complete or not, nor moves the pointer of a run:
    the root it writes into holds no iteration and no pointer yet."""
    if (directory / layout.DCP_METADATA).exists() or (directory / layout.MARKER).exists():
        raise CheckpointError(f"{directory} already holds a checkpoint; convert into a new directory")
    refuse_run_root(directory.parent)


def refuse_run_root(root: str | Path) -> None:
    """A conversion writes a new checkpoint root: one holding a run's iterations (any iter_*
    directory, a Megatron one or an unsealed one included) or pointer is refused (its pointer would
    move to the conversion, and resuming there would replace the run)."""
    root = Path(root)
    found = layout.list_iterations(root)
    if found or (root / layout.POINTER).exists():
        held = f"iterations {found[0]}..{found[-1]}" if found else f"a {layout.POINTER}"
        raise CheckpointError(
            f"{root} already holds checkpoints ({held}): a conversion writes a new checkpoint directory and never "
            "moves another run's pointer; convert into a new directory (nothing was written)"
        )


def to_torch_file(directory: Path, out: str | Path, weights_only: bool = False) -> None:
    """One torch.save file of full tensors: every section, the iteration and the config text.
    An existing file at `out` is refused: a conversion replaces nothing it did not make."""
    if Path(out).is_file():
        raise CheckpointError(f"{out} already exists: to-torch writes a new file and replaces nothing; "
                              "choose another path or remove it (nothing was written)")
    sections = read_sections(directory, ("model",) if weights_only else None)
    marker = layout.read_marker(directory)
    config_text = (directory / layout.CONFIG).read_text() if (directory / layout.CONFIG).is_file() else ""
    header = {"format": TORCH_FORMAT, "iteration": marker.get("iteration", 0), "config": config_text, "mesh": marker.get("mesh")}
    with open(out, "wb") as f:  # an OSError naming the path (torch.save's own is a RuntimeError)
        torch.save({**header, **sections}, f)


def from_torch_file(path: str | Path, root: str | Path, config_path: str | None = None, iteration: int | None = None) -> Path:
    """A torch file (ours from to_torch_file, or a plain model state_dict) -> a DCP checkpoint."""
    try:
        with warnings.catch_warnings():  # torch's notes on a foreign pickle protocol: the error below says it
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - random bytes fail in many ways inside the unpickler; all read the same
        # weights_only refuses anything but tensors and containers: a crafted file ends here too
        raise CheckpointError(f"{path} is not a torch file of tensors that dtgpt reads: {load_problem(path, e)}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a dict of tensors")
    if data.get("format") == TORCH_FORMAT:
        sections = {k: v for k, v in data.items() if k not in ("format", "iteration", "config", "mesh")}
        step = data["iteration"] if iteration is None else iteration
        if config_path:
            cfg = load_config(config_path)
        elif data["config"]:
            cfg = _config_from_text(data["config"])
        else:
            raise CheckpointError(f"{path} carries no config; pass --config")
    else:
        if not config_path:
            raise CheckpointError(f"{path} is a plain state_dict without a config; pass --config")
        sections, step, cfg = {"model": dict(data)}, iteration or 0, load_config(config_path)
    return write_checkpoint(root, step, sections, cfg, source=str(path), mesh=data.get("mesh"))


def _config_from_text(text: str) -> Config:
    saved = tomllib.loads(text)
    cfg = as_saved(config_from_dict(saved, "the config stored in the torch file"), saved)
    validate(cfg)
    return cfg


HF_LAYOUTS = (gpt2.LAYOUT, hf_llama.LAYOUT, hf_deepseek.LAYOUT)


def hf_layout_for(m: ModelConfig) -> HFLayout:
    """The Hugging Face layout that holds the model: GPT2LMHeadModel (learned positions,
    LayerNorm, GeLU), LlamaForCausalLM (RoPE, RMSNorm, SwiGLU) or DeepseekV3ForCausalLM
    (multi-latent attention, MoE, prediction modules); ValueError naming the settings each
    would need when none does."""
    moe = [hf_files.need("num_experts", None, m)] if m.num_experts else []
    moe += [hf_files.need("mtp_num_layers", None, m)] if m.mtp_num_layers else []
    needs = [(hf, ([] if hf.holds_experts else moe) + hf.problems(m)) for hf in HF_LAYOUTS]
    for hf, problems in needs:
        if not problems:
            return hf
    wanted = "; ".join(f"{hf.architecture} needs {', '.join(problems)}" for hf, problems in sorted(needs, key=lambda n: len(n[1])))
    raise ValueError(f"no Hugging Face model holds this one: {wanted}")


def hf_layout_of(config: dict, source: str) -> HFLayout:
    """The layout config.json names (model_type, else architectures)."""
    architectures = config.get("architectures") or []
    for hf in HF_LAYOUTS:
        if config.get("model_type") == hf.model_type or (not config.get("model_type") and hf.architecture in architectures):
            return hf
    known = " or ".join(hf.architecture for hf in HF_LAYOUTS)
    raise ValueError(f"{source}: model_type={config.get('model_type')!r} (architectures {architectures}) is not {known}")


def to_hf_dir(directory: Path, cfg: Config, out: str | Path) -> tuple[str, list[str]]:
    """Write the checkpoint as a directory transformers loads whole: weights, config.json,
    generation_config.json and the run's tokenizer. Returns the architecture and the names of
    the files written."""
    out = Path(out)
    _refuse_model_dir(out)
    hf = hf_layout_for(cfg.model)
    tokenizer = build_tokenizer(cfg.data)
    tokenizer_json = hf_tokenizer.exportable_backend(tokenizer)
    vocab = model_vocab_size(directory)
    _check_tokenizer_fits(tokenizer.vocab_size, vocab, directory)
    model = hf_files.gamma_from_stored(read_sections(directory, ("model",))["model"], cfg.model)
    hf_files.write_hf_dir(out, hf.to_hf(model, cfg.model), hf.config(cfg.model, vocab, tokenizer.eod),
                          hf_files.generation_config(tokenizer.eod, tokenizer.vocab_size, vocab))  # fmt: skip
    written = hf_tokenizer.write_tokenizer_files(out, tokenizer, tokenizer_json, cfg.model.max_positions)
    return hf.architecture, [hf_files.HF_CONFIG, hf_files.GENERATION_CONFIG, hf_files.SAFETENSORS, *written]


def _refuse_model_dir(out: Path) -> None:
    """to-hf writes a new directory: one that already holds a model's files (another export, a
    downloaded model) is refused, so nothing the command did not make is replaced."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise CheckpointError(f"{out} is not empty (it holds {shown}): to-hf writes a new directory and replaces nothing; "
                              "choose another one (nothing was written)")


def from_hf_dir(src: str | Path, root: str | Path, cfg: Config, iteration: int = 0) -> tuple[Path, str]:
    """Import a GPT-2, Llama or DeepSeek-V3 directory (ours or Hugging Face's) into a DCP checkpoint under root.

    The model's architecture comes from config.json and the tokenizer keys from the tokenizer
    files found; the rest of `cfg` is kept, the storage conventions (hf_files.CONVENTIONS)
    included, and the tensors are converted to them. Returns the iteration directory and a line
    saying what was read.
    """
    src, source = Path(src), str(Path(src) / hf_files.HF_CONFIG)
    directory = layout.iteration_dir(root, iteration)
    _refuse_existing(directory)
    tensors, config = hf_files.read_hf_dir(src)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}  # fp32 master weights
    hf = hf_layout_of(config, source)
    try:
        overrides = hf.overrides(config, tensors, source)
    except KeyError as e:
        raise ValueError(f"{source}: no {e.args[0]!r}, which a {hf.architecture} config.json names") from None
    cfg.model = hf_checks.replace_model(cfg.model, overrides, source)
    cfg.model.seq_length = min(cfg.model.seq_length, cfg.model.max_positions)
    # the architecture config.json describes (e.g. a size of 0) is checked before the tokenizer is copied
    validate(dataclasses.replace(cfg, data=DataConfig(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=config["vocab_size"] + 1)))
    vocab = padded_vocab_size(config["vocab_size"], cfg.model.make_vocab_size_divisible_by)
    model = hf_files.stored_from_gamma(hf.from_hf(tensors, cfg.model, vocab), cfg.model)
    from dtgpt.checkpoint.megatron.keys import full_model_shapes  # here: that package imports this module

    hf_checks.check_tensors(model, full_model_shapes(cfg.model, vocab), str(src))
    with _removed_on_failure(Path(root), directory):
        return _write_hf_import(src, root, directory, cfg, iteration, config, hf, vocab, model)


def _write_hf_import(src, root, directory, cfg, iteration, config, hf, vocab, model) -> tuple[Path, str]:
    found = hf_tokenizer.recognise(src, keep_in=directory) or {}
    if not (cfg.data.mock_data or cfg.data.data_path or cfg.data.builtin_corpus or cfg.data.train_data_path):
        cfg.data.mock_data = True  # a placeholder so the stored config validates; set real data to train
    if found.get("tokenizer_type") == "NullTokenizer" and cfg.data.mock_data:
        found["vocab_size"] += 1  # under mock data vocab_size counts the eod too (null_tokenizer_ids)
    for key, value in found.items():
        setattr(cfg.data, key, value)
    validate(cfg)
    if found:  # fail here, not at the first use, when the tokenizer does not fit the model
        _check_tokenizer_fits(build_tokenizer(cfg.data).vocab_size, vocab, src)
    write_checkpoint(root, iteration, {"model": model}, cfg, source=str(src), checked=True)
    kind = cfg.data.tokenizer_type if found else f"none found, kept data.tokenizer_type={cfg.data.tokenizer_type!r}"
    return directory, f"{hf.architecture}, vocabulary {config['vocab_size']} padded to {vocab}; tokenizer: {kind}"


@contextlib.contextmanager
def _removed_on_failure(root: Path, directory: Path):
    """A failed import leaves nothing: the directories it created (and the files it copied
    into them) are removed; what existed before is left alone."""
    made = [p for p in (root, directory) if not p.exists()]
    try:
        yield
    except BaseException:
        for path in reversed(made):
            shutil.rmtree(path, ignore_errors=True)
        raise


def _check_tokenizer_fits(tokens: int, rows: int, where: Path) -> None:
    if tokens > rows:
        raise CheckpointError(f"{where}: the tokenizer has {tokens} tokens but the model's vocabulary only {rows} rows")
