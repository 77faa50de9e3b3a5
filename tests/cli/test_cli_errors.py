"""Bad input gives a one-line `error:` naming the problem and what to do, never a traceback."""

import json
import os
import subprocess
import sys

import pytest

from tiny_models import write_tiny_hf_model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "qkiln", *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(result, *needles, code: int | None = None):
    """code: the exit code README's table gives this kind of error (2 usage, 3 source model,
    4 recipe, 5 data, 6 artifact or output path, 7 target unavailable)."""
    assert result.returncode != 0 if code is None else result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_help_on_every_subcommand():
    out = run_cli("--help")
    assert out.returncode == 0 and "eval" in out.stdout
    assert run_cli("eval", "--help").returncode == 0


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("qkiln 0.")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_on_a_taken_port_says_so_before_loading_anything(tmp_path, host):
    import socket

    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as taken:
        port = taken.getsockname()[1]
        result = run_cli("serve", str(tmp_path / "not-even-loaded"), "--host", host, "--port", str(port))
    assert_one_line_error(result, f"cannot listen on {host}:{port}", "pick another --port", code=2)
    assert "serving" not in result.stderr
    from qkiln.cli import _check_port_free

    _check_port_free(host, port)  # free again: passes (an IPv6 host was refused as "address family")


@pytest.mark.parametrize("args, needle", [
    (("build", "m", "--recipe", "w4a16-rtn", "-o", "x", "--bogus-flag"), "No such option: --bogus-flag (see '"),
    (("bench", "throughput"), "Missing argument 'model'. (see '"),
    (("nosuchcommand",), "No such command 'nosuchcommand'"),
    (("serve", "m", "--port", "70000"), "'--port'"),  # was an OverflowError traceback, exit 1
    (("serve", "m", "--host", "nosuch.invalid"), "cannot resolve --host nosuch.invalid"),
])
def test_a_malformed_command_line_is_one_error_line(args, needle):
    """click printed a usage block with `Error:` on its fourth line, which `grep ^error:` missed."""
    result = run_cli(*args)
    assert_one_line_error(result, needle, code=2)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_model_folder_given_where_an_artifact_belongs_is_named_with_what_to_do(tmp_path):
    """export / verify of an HF folder said the build had not completed and to rerun qkiln build."""
    import json

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert_one_line_error(run_cli("verify", str(model)), "a Hugging Face model, not a qkiln artifact",
                          f"qkiln build {model} --recipe RECIPE", code=6)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {}}))
    assert_one_line_error(run_cli("export", str(model), "-o", str(tmp_path / "e")),
                          "a Hugging Face quantized checkpoint", f"qkiln import {model} -o ARTIFACT", code=6)


def test_a_recipe_that_is_not_yaml_is_one_error_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\nscheme: {weights: [\n")
    result = run_cli("build", str(tmp_path), "--recipe", str(recipe), "-o", str(tmp_path / "out"))
    assert_one_line_error(result, "bad.yaml is not valid YAML: expected the node content", "line 3, column 1", code=4)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_folder_that_is_neither_artifact_nor_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert_one_line_error(run_cli("generate", str(tmp_path), "--prompt", "hi"), "neither a qkiln artifact", code=3)


def test_missing_model(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    assert_one_line_error(run_cli("eval", str(tmp_path / "nope"), "--data", str(tmp_path / "t.txt")), "not found", code=3)


def test_missing_data_file(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    assert_one_line_error(run_cli("eval", str(tmp_path / "m"), "--data", str(tmp_path / "x.txt")), "does not exist", code=5)


def test_unsupported_architecture(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    (tmp_path / "t.txt").write_text("hello")
    assert_one_line_error(run_cli("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt")), "not supported", code=3)


def test_corrupt_safetensors(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    f = tmp_path / "m/model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    (tmp_path / "t.txt").write_text("hello")
    assert_one_line_error(run_cli("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt")), "safetensors", code=3)


@pytest.mark.parametrize("cut", [100, 5_000_000])
def test_corrupt_gguf(tmp_path, smollm2, cut):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(smollm2.path.read_bytes()[:cut])
    (tmp_path / "t.txt").write_text("hello")
    assert_one_line_error(run_cli("eval", str(bad), "--data", str(tmp_path / "t.txt")), "GGUF")


def test_int8_activations_on_a_source_model(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello")
    for args in (("generate", str(tmp_path / "m"), "--prompt", "hi"),
                 ("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"))):
        assert_one_line_error(run_cli(*args, "--int8-activations"), "int8 activations", "qkiln build", code=2)


def test_sampling_options_out_of_range_are_refused_before_loading(tmp_path):
    assert_one_line_error(run_cli("generate", str(tmp_path / "not-loaded"), "--prompt", "hi", "--min-p", "2"),
                          "min_p must be in [0, 1]", code=2)


def test_engine_options_that_do_not_go_together(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello")
    base = ("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"))
    assert_one_line_error(run_cli(*base, "--engine", "tensorrt"), "onnx or onnxruntime")
    assert_one_line_error(run_cli(*base, "--engine", "onnx", "--ort-accuracy-level", "4"), "--engine onnxruntime")
    assert_one_line_error(run_cli(*base, "--engine", "onnxruntime", "--ort-accuracy-level", "7"), "0..4")


def test_eval_refuses_what_it_cannot_score(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello there " * 40)
    (tmp_path / "short.txt").write_text("hi")
    base = ("eval", str(tmp_path / "m"), "--seq-len", "32")
    assert_one_line_error(run_cli(*base, "--data", str(tmp_path)), "is not a file", code=5)  # before loading
    assert_one_line_error(run_cli(*base, "--data", str(tmp_path / "short.txt")), "fewer than one window", code=5)
    assert_one_line_error(run_cli(*base, "--data", str(tmp_path / "t.txt"), "--batch-size", "0"), "--batch-size", code=2)
    assert_one_line_error(run_cli("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"),
                                  "--seq-len", "100000"), "exceeds the model's context")
    report = tmp_path / "new" / "dir" / "r.json"  # a folder that is not there yet is made, not a lost report
    done = run_cli(*base, "--data", str(tmp_path / "t.txt"), "--eval-tokens", "64", "--json", str(report))
    assert done.returncode == 0 and json.loads(report.read_text())["num_tokens"] > 0, done.stderr
    written = json.loads(report.read_text())  # what moves a score's last digits is recorded beside it
    assert written["batch_size"] == 4 and written["toolchain"]["torch"] and written["toolchain"]["qkiln"]
    # stdout a pipe its reader closed (`| head`), unbuffered as in CI images: the file had been lost
    piped = tmp_path / "piped.json"
    reader, writer = os.pipe()
    os.close(reader)
    done = subprocess.run([sys.executable, "-m", "qkiln", *base, "--data", str(tmp_path / "t.txt"), "--eval-tokens",
                           "64", "--json", str(piped)], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=300,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
    os.close(writer)
    assert json.loads(piped.read_text()) == json.loads(report.read_text()) and "Traceback" not in done.stderr
    assert_one_line_error(run_cli(*base, "--data", str(tmp_path / "t.txt"), "--json", str(tmp_path / "t.txt" / "r.json")),
                          "t.txt is a file, not a folder", code=6)


def test_build_refuses_a_bad_archive_name_before_building(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    result = run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "a"),
                     "--archive", str(tmp_path / "a.zip"))
    assert_one_line_error(result, "a.zip", ".tar", code=6)
    assert not (tmp_path / "a").exists()  # refused before the build, not after writing the artifact
    # an artifact whose archive is missing (its build was killed while archiving): said so
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("{}")
    result = run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "a"),
                     "--archive", str(tmp_path / "a.tar"))
    assert_one_line_error(result, "already exists, its --archive", "a.tar does not", "--force", code=6)


def test_artifact_without_manifest_is_named_as_such(tmp_path):
    """A folder with an artifact's layout but no manifest.json (written last) is an incomplete artifact,
    not 'a Hugging Face directory without config.json'."""
    (tmp_path / "a/weights").mkdir(parents=True)
    (tmp_path / "a/weights/model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    assert_one_line_error(run_cli("generate", str(tmp_path / "a"), "--prompt", "hi"), "no manifest.json", "rebuild", code=6)


def test_options_a_data_free_recipe_does_not_use_are_not_recorded(tmp_path):
    """--num-samples on w4a16-rtn (or --eval-tokens with no evaluation data) changed the manifest,
    and its digest, of identical weights."""
    write_tiny_hf_model(tmp_path / "m")
    digests = []
    for i, extra in enumerate(([], ["--num-samples", "8", "--eval-tokens", "64"])):
        done = run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "x" / "a"),
                       "--force", "--no-cache", *extra)
        assert done.returncode == 0, done.stderr
        assert ("are not used" in done.stderr) == ("--eval-tokens / --eval-seq-len apply" in done.stderr) == bool(extra)
        digests.append(json.loads((tmp_path / "x" / "a" / "manifest.json").read_text())["digest"])
    assert digests[0] == digests[1]


def test_an_artifact_given_as_a_build_source_is_named_as_one(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    assert run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "a")).returncode == 0
    again = run_cli("build", str(tmp_path / "a"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "b"))
    assert_one_line_error(again, "is a qkiln artifact, already quantized")  # was: "has no manifest.json"


def test_eval_refuses_a_reference_that_reads_other_text_and_windows_past_the_context(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello there, general kenobi " * 40)
    base = ("eval", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), "--seq-len", "32", "--eval-tokens", "96")
    other = write_tiny_hf_model(tmp_path / "other", seed=1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped: scored other text (a KL of nonsense)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert_one_line_error(run_cli(*base, "--reference", str(other)), "tokenizer or vocabulary differs")
    short = write_tiny_hf_model(tmp_path / "short", max_position_embeddings=16)
    assert_one_line_error(run_cli(*base, "--reference", str(short)), "exceeds the reference's context of 16", code=2)
    same = run_cli(*base, "--reference", str(write_tiny_hf_model(tmp_path / "same", seed=2)))
    report = json.loads(same.stdout)
    assert same.returncode == 0 and report["kl_divergence"] > 0 and report["reference_perplexity"] > 1
    assert report["sha256"] and report["num_bytes"] > 0
    assert report["bits_per_byte"] == report["nll_nats"] / 0.6931471805599453 / report["num_bytes"]
    (tmp_path / "out").mkdir()
    assert_one_line_error(run_cli(*base, "--json", str(tmp_path / "out")), "is a directory", code=6)  # was lost after scoring
    assert_one_line_error(run_cli(*base, "--served", "--reference", str(tmp_path / "m")), "KL needs")
    assert_one_line_error(run_cli(*base, "--dtype", "bf16"), "--dtype applies to --served")
    (tmp_path / "t.json").write_text('{"text": "hello there, general kenobi"}\n' * 40)
    as_json = run_cli(*base[:3], str(tmp_path / "t.json"), *base[4:])
    assert as_json.returncode == 0 and "JSON syntax included" in as_json.stderr  # scored, but said so
    (tmp_path / "t.jsonl").write_text('{"text": "hello there, general kenobi"}\n' * 40)
    jsonl = run_cli(*base[:3], str(tmp_path / "t.jsonl"), *base[4:], "--json", str(tmp_path / "j.json"))
    assert jsonl.returncode == 0 and json.loads((tmp_path / "j.json").read_text())["protocol"]["data"] == "t.jsonl#text"


def test_a_window_with_its_bos_must_fit_the_context(tmp_path):
    model = write_tiny_hf_model(tmp_path / "m", max_position_embeddings=32)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
    (tmp_path / "t.txt").write_text("hello there " * 40)
    base = ("eval", str(model), "--data", str(tmp_path / "t.txt"), "--max-tokens", "96")  # the older name
    assert_one_line_error(run_cli(*base, "--seq-len", "32"), "a window of 33 tokens")  # was an IndexError
    assert run_cli(*base, "--seq-len", "31").returncode == 0
    # --served scores a window that fills the context too (the engine takes such a prompt)
    served = run_cli(*base, "--seq-len", "31", "--served")
    assert served.returncode == 0, served.stderr


def test_build_takes_the_accuracy_report_s_window(tmp_path):
    write_tiny_hf_model(tmp_path / "m")
    (tmp_path / "t.txt").write_text("hello there, general kenobi " * 40)
    done = run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "a"), "--no-cache",
                   "--eval-data", str(tmp_path / "t.txt"), "--eval-seq-len", "32", "--eval-tokens", "128")
    assert done.returncode == 0, done.stderr
    protocol = json.loads((tmp_path / "a" / "manifest.json").read_text())["accuracy"]["protocol"]
    assert (protocol["seq_len"], protocol["max_tokens"]) == (32, 128)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_exit_codes_say_what_kind_of_failure_it_was(tmp_path):
    """A deploy script retries elsewhere on 7 (a sound artifact for a device this host lacks),
    rebuilds on 6, fixes its recipe on 4: all of these were exit 2."""
    write_tiny_hf_model(tmp_path / "m")
    assert_one_line_error(run_cli("build", str(tmp_path / "m"), "--recipe", "w5a16-magic", "-o", str(tmp_path / "r")),
                          "w5a16-magic", code=4)
    built = run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "--target", "cuda", "-o", str(tmp_path / "a"))
    assert built.returncode == 0, built.stderr
    assert_one_line_error(run_cli("verify", str(tmp_path / "a")), "CUDA is not available", code=7)
    (tmp_path / "a" / "manifest.json").write_text("{}")
    assert_one_line_error(run_cli("verify", str(tmp_path / "a")), "manifest", code=6)


def test_int8_activations_without_the_native_kernels_are_refused_not_ignored(tmp_path):
    """torch's kernels compute exactly: the option had changed nothing while the report said
    "with int8 activations" (an accuracy job compared two identical numbers)."""
    write_tiny_hf_model(tmp_path / "m")
    assert run_cli("build", str(tmp_path / "m"), "--recipe", "w4a16-rtn", "-o", str(tmp_path / "a")).returncode == 0
    result = subprocess.run([sys.executable, "-m", "qkiln", "generate", str(tmp_path / "a"), "--prompt", "hi",
                             "--int8-activations"], capture_output=True, text=True, timeout=300,
                            env=os.environ | {"QKILN_NATIVE_CPU": "0"})
    assert_one_line_error(result, "int8 activations run in qkiln's native CPU kernels", code=2)


def test_generate_takes_a_prompt_from_a_file_and_says_when_the_context_cut_it_short(tmp_path):
    """A document too long for a command line ('Argument list too long') had no way in, and a
    generation the context cut short ended silently with exit 0."""
    write_tiny_hf_model(tmp_path / "m")  # a 1024-token context, a byte-level vocabulary
    (tmp_path / "p.txt").write_text("ab" * 500)  # 1000 tokens
    cut = run_cli("generate", str(tmp_path / "m"), "--prompt-file", str(tmp_path / "p.txt"), "--max-tokens", "64")
    assert cut.returncode == 0, cut.stderr
    assert "note: stopped after 24 of --max-tokens 64: with the prompt's 1000 tokens they fill the 1024" in cut.stderr
    assert_one_line_error(run_cli("generate", str(tmp_path / "m"), "--prompt", "x", "--prompt-file",
                                  str(tmp_path / "p.txt")), "--prompt TEXT or --prompt-file PATH", code=2)
    assert_one_line_error(run_cli("generate", str(tmp_path / "m"), "--prompt-file", str(tmp_path / "none.txt")),
                          "cannot be read", code=2)


def test_generate_says_when_the_model_recommends_other_sampling_values(tmp_path):
    """serve and LLM.generate take the model's generation_config.json values for what a request leaves
    out; this command uses its own options (greedy) and had not said that the model recommends others."""
    import json

    model = write_tiny_hf_model(tmp_path / "m")
    plain = run_cli("generate", str(model), "--prompt", "hi", "--max-tokens", "2")
    assert plain.returncode == 0 and "recommends" not in plain.stderr, plain.stderr
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    noted = run_cli("generate", str(model), "--prompt", "hi", "--max-tokens", "2")
    assert noted.returncode == 0, noted.stderr
    assert "note: the model recommends {'temperature': 0.6, 'top_p': 0.9} (its generation config)" in noted.stderr
    followed = run_cli("generate", str(model), "--prompt", "hi", "--max-tokens", "2", "--temperature", "0.6")
    assert followed.returncode == 0 and "recommends {'top_p': 0.9}" in followed.stderr, followed.stderr


@pytest.mark.parametrize("option", ["--api-key", "--served-model-name"])
def test_serve_refuses_an_empty_key_or_name_before_loading(tmp_path, option):
    """`--api-key ""` served behind an empty bearer token and `--served-model-name ""` under the
    model's own name, both silently (a deploy template's unset variable)."""
    result = run_cli("serve", str(tmp_path / "never-loaded"), option, "")
    assert_one_line_error(result, f"{option} is empty: give one, or leave the option out", code=2)


def test_the_package_says_its_version():
    import importlib.metadata

    import qkiln

    assert qkiln.__version__ == importlib.metadata.version("qkiln")


def test_a_path_under_a_folder_this_user_may_not_enter_is_an_error_line(other_user):
    # Python 3.11's Path.exists() raises PermissionError there: `-o /root/out` as another user was a traceback
    locked = other_user.folder / "locked"
    locked.mkdir(mode=0o700)  # root's
    for args in (["generate", str(locked / "artifact"), "--prompt", "hi"],
                 ["build", "smollm2-135m", "--recipe", "w4a16-rtn", "-o", str(locked / "out")]):
        out = other_user.python("import sys; from qkiln.cli import main; sys.argv = ['qkiln', *sys.argv[1:]]; main()",
                                *args)
        assert_one_line_error(out, str(locked), "permission denied", code=2)
    out = other_user.python("import sys; from qkiln.cli import main; sys.argv = ['qkiln', *sys.argv[1:]]; main()",
                            "verify", locked / "artifact", "--json")
    assert_one_line_error(out, "permission denied", code=2)
    assert json.loads(out.stdout)["ok"] is False  # the one object a pipeline parses, there too


@pytest.mark.parametrize("args,flag", [
    (["serve", "no-such-model", "--kv-cache-mb", "-5"], "'--kv-cache-mb'"),  # was "kv_cache_bytes ... -5242880"
    (["serve", "no-such-model", "--max-num-seqs", "0"], "'--max-num-seqs'"),
    (["generate", "no-such-model", "--prompt", "hi", "--max-tokens", "0"], "'--max-tokens'"),  # was "or None"
])
def test_a_flag_out_of_range_is_named_as_typed(args, flag):
    assert_one_line_error(run_cli(*args), flag, "greater than or equal to 1", code=2)


def test_an_allowed_origin_no_browser_sends_is_refused_before_loading():
    # "app.example" matched no Origin header: the browser's preflight got a 400
    for origin in ("app.example", "https://app.example/"):
        assert_one_line_error(run_cli("serve", "no-such-model", "--allowed-origin", origin),
                              f"allowed origin '{origin}'", "scheme://host[:port]", code=2)
