"""Chat templates run as transformers runs them: sandboxed (a template ships with a downloaded
model, so it must not reach Python), with the extensions and globals real templates call. The
rendering is compared with transformers' apply_chat_template on the same files."""

import json

import httpx
import pytest
import transformers

from qkiln.errors import SourceModelError
from qkiln.runtime.tokenizer import Tokenizer
from loopback import serving_model
from tiny_models import write_tiny_hf_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo ✓"}]


def with_template(model_dir, template: str):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return model_dir


def rendered_by_transformers(model_dir, messages=MESSAGES) -> str:
    return transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture
def model_dir(tmp_path):
    return write_tiny_hf_model(tmp_path, "llama")


def test_a_template_reaching_for_python_is_refused_not_run(model_dir, tmp_path):
    marker = tmp_path / "written_by_the_template"
    with_template(model_dir, "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
                             "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(SourceModelError, match="chat template error"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)
    assert not marker.exists()
    with serving_model(model_dir, dtype="fp32", num_kv_blocks=16, max_model_len=64) as (_, server):
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert reply.status_code == 400 and "chat template error" in reply.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert not marker.exists()


@pytest.mark.parametrize("template", [
    # loop controls (Llama 3.1's tool templates break out of loops)
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    # tojson keeps non-ASCII text, as transformers' filter does
    "{% for m in messages %}{{ m | tojson }}{% endfor %}{{ messages[1].content | tojson(indent=2) }}",
    # the date Llama 3.2's template writes into its system prompt
    "Today {{ strftime_now('%Y') }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    # trim_blocks / lstrip_blocks
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}\n"
    "{% if add_generation_prompt %}<assistant>{% endif %}",
])
def test_templates_render_as_transformers_renders_them(model_dir, template):
    with_template(model_dir, template)
    assert Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES) == rendered_by_transformers(model_dir)


@pytest.mark.parametrize("template, kwargs", [
    ("{{ 1 / 0 }}", {}),  # a Python error inside the template
    ("{{ range(10**9) | list }}", {}),  # the sandbox's own limit
    ("{{ raise_exception('x') }}", {"raise_exception": "not callable"}),  # a variable shadowing a global
])
def test_any_error_the_template_raises_is_the_models_error(model_dir, template, kwargs):
    with_template(model_dir, template)
    with pytest.raises(SourceModelError, match="chat template error"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES, template_kwargs=kwargs)


def test_template_kwargs_may_replace_the_special_tokens_as_in_transformers(model_dir):
    with_template(model_dir, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.apply_chat_template(MESSAGES, template_kwargs={"bos_token": "<s>"}).startswith("<s>Be brief.")
    assert tokenizer.apply_chat_template(MESSAGES, template_kwargs={"messages": []}) == "<|bos|>Be brief.Héllo ✓"


def test_raise_exception_and_syntax_errors_are_the_models_errors(model_dir):
    with_template(model_dir, "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
                             "{% endif %}")
    with pytest.raises(SourceModelError, match="System role not supported"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)
    with_template(model_dir, "{% for m in messages %}{{ m.content }")
    with pytest.raises(SourceModelError, match="does not parse"):
        Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES)


def test_special_tokens_stored_as_added_token_dicts_render_as_their_text(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config |= {"bos_token": {"content": "<|bos|>", "special": True, "__type": "AddedToken"},
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(model_dir).apply_chat_template(MESSAGES) == "<|bos|>Be brief.<|eos|>Héllo ✓<|eos|>"


def test_a_template_saved_in_its_own_file_is_used(model_dir, tmp_path):
    """transformers 5 saves it as chat_template.jinja, not in tokenizer_config.json."""
    with_template(model_dir, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(saved)
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    assert Tokenizer.from_dir(saved).apply_chat_template(MESSAGES) == rendered_by_transformers(saved)


NAMED = [{"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
         {"name": "tool_use", "template": "{{ tools | length }} tools:{% for m in messages %}{{ m.content }}{% endfor %}"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def test_named_templates_are_picked_as_transformers_picks_them(model_dir, tmp_path):
    """Hermes' and Command-R's form: only "default" was kept, so tools went unsaid, and
    chat_template="tool_use" rendered the text "tool_use" (probe s50)."""
    with_template(model_dir, NAMED)
    tokenizer, reference = Tokenizer.from_dir(model_dir), transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.apply_chat_template(MESSAGES) == "Be brief.Héllo ✓"
    for kwargs in ({"tools": TOOLS}, {"chat_template": "tool_use", "tools": TOOLS}, {"chat_template": "default"}):
        expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        variables = {"tools": kwargs["tools"]} if "tools" in kwargs else None
        assert tokenizer.apply_chat_template(MESSAGES, template_kwargs=variables,
                                             chat_template=kwargs.get("chat_template")) == expected
    assert expected == "Be brief.Héllo ✓" and "1 tools:" in tokenizer.apply_chat_template(
        MESSAGES, template_kwargs={"tools": TOOLS})
    # transformers 5 saves them as chat_template.jinja + additional_chat_templates/tool_use.jinja; a
    # saved tokenizer (an artifact's) keeps them in tokenizer_config.json's named form
    reference.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "additional_chat_templates" / "tool_use.jinja").is_file()
    Tokenizer.from_dir(tmp_path / "saved").save(tmp_path / "ours")
    for folder in ("saved", "ours"):
        assert "1 tools:" in Tokenizer.from_dir(tmp_path / folder).apply_chat_template(
            MESSAGES, template_kwargs={"tools": TOOLS})


def test_the_generation_tag_renders_its_body_as_transformers_does(model_dir):
    """TRL's assistant-only-loss fine-tunes and SmolLM3 mark the assistant's turns with it: every
    chat request was a 400 "the chat template does not parse" (probe s50)."""
    with_template(model_dir, "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                             "<a>{{ m.content }}{% endgeneration %}{% else %}<u>{{ m.content }}{% endif %}{% endfor %}")
    messages = MESSAGES + [{"role": "assistant", "content": "Hi."}]
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == rendered_by_transformers(model_dir, messages)


def test_none_valued_message_keys_are_left_out_as_transformers_leaves_them(model_dir):
    """An OpenAI SDK message (model_dump()) has tool_calls: None; content None was printed "None"."""
    from qkiln.runtime import LLM, SamplingParams

    with_template(model_dir, "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]"
                             "{% if 'tool_calls' in m %}{{ m.tool_calls | length }}{% endif %}{{ m.content }}"
                             "{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": None, "refusal": None}]
    expected = rendered_by_transformers(model_dir, messages)
    assert expected.startswith("[user:ann]hi[assistant]") and "None" not in expected
    llm = LLM(str(model_dir), dtype="fp32", num_kv_blocks=8)
    assert llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    with serving_model(model_dir, dtype="fp32", num_kv_blocks=16, max_model_len=64) as (_, server):
        ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages[:1]}).json()["tokens"]
        assert llm.tokenizer.decode(ids).startswith("[user:ann]hi")  # the server passes `name` on, as vLLM does


LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
               "{{ m.content | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.mark.parametrize("final", ["The answer is ", "d", "ok\n", "<|eot"])
def test_continue_final_message_ends_where_transformers_ends(model_dir, final):
    """Cut at a tag appended to the message: a trimmed trailing space and a message whose last
    characters also occur in the closing tokens (had cut at the wrong place, silently)."""
    with_template(model_dir, LLAMA3_LIKE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    expected = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages, False, continue_final_message=True) == expected


THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")


def test_chat_template_kwargs_reach_the_template_offline_and_served(model_dir):
    from qkiln.runtime import LLM, SamplingParams

    with_template(model_dir, THINKING)
    kwargs = {"enable_thinking": False}
    expected = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert expected.endswith("<think></think>")
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.apply_chat_template(MESSAGES, template_kwargs=kwargs) == expected
    llm = LLM(str(model_dir), dtype="fp32", num_kv_blocks=16)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template_kwargs=kwargs)[0]
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    own = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template="{{ messages[1].content }}")[0]
    assert own.prompt_token_ids == tokenizer.encode("Héllo ✓", add_special_tokens=False)
    with serving_model(model_dir, dtype="fp32", num_kv_blocks=16, max_model_len=64) as (_, server):
        body = {"messages": MESSAGES, "max_tokens": 1}
        plain = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
        thinking_off = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"chat_template_kwargs": kwargs})
        assert thinking_off.json()["usage"]["prompt_tokens"] == len(out.prompt_token_ids) \
            == plain["usage"]["prompt_tokens"] + len("<think></think>".encode())  # byte tokens
        for field, value in (("chat_template", "{{ messages }}"), ("documents", [{"text": "x"}]), ("echo", True),
                             ("chat_template_kwargs", {"messages": []})):
            refused = httpx.post(f"{server.url}/v1/chat/completions", json=body | {field: value})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        tool_call = {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"messages": [*MESSAGES, tool_call]})
        assert refused.status_code == 400 and "tool_calls" in refused.json()["error"]["message"]


SPIN = ("{% if messages[-1].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_a_template_that_spins_or_allocates_is_stopped_and_the_server_keeps_serving(model_dir, monkeypatch):
    """A template is the model's code: nested loops held the threads that render and encode
    prompts, until no request of any kind was answered, and `'x' * 2**33` took 8 GB (probe s48).
    A render past its deadline, a huge repetition or power, is a chat template error (400)."""
    import threading
    import time

    from qkiln.runtime import template_limits

    monkeypatch.setattr(template_limits, "RENDER_SECONDS", 0.5)
    tokenizer = Tokenizer.from_dir(with_template(model_dir, SPIN))
    outcome = []

    def spin():
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "spin"}])
        except SourceModelError as e:
            outcome.append(str(e))

    started = time.monotonic()
    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    worker.join(30)
    assert outcome and "ran past 0.5 s" in outcome[0] and time.monotonic() - started < 5, outcome
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("hi")

    with serving_model(model_dir, dtype="fp32", num_kv_blocks=16, max_model_len=64) as (_, server), \
            httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"model": "tiny", "max_tokens": 2}
        spun = [client.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": "spin"}]})
                for _ in range(8)]  # more than the threads that render prompts
        assert all(r.status_code == 400 and "ran past" in r.text for r in spun), spun[0].text
        answered = client.post("/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": "hi"}]})
        assert answered.status_code == 200, answered.text

    for template in ("{{ 'x' * 2**33 }}", "{{ 'x' * 100000000 }}", "{{ [0] * 10**9 }}", "{{ 10 ** 100000 }}"):
        with pytest.raises(SourceModelError, match="chat template error: .*past the"):
            Tokenizer.from_dir(with_template(model_dir, template)).apply_chat_template(MESSAGES)
