"""Triton's classification extension and the inputs' format, without a server
(issue 20 §3). End to end, with tritonclient: test_triton_examples."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.repository import TensorSpec, parse_model_settings
from poolserve.service.contract.settings import ConfigError
from poolserve.service.inference.cargo import InferenceCargo
from poolserve.service.inference.classification import (
    LabelFileError,
    read_labels,
    requested_classes,
    top_classes,
)
from poolserve.service.inference.codec import decode_outputs
from poolserve.service.inference.infer import infer
from poolserve.service.inference.introsort import triton_sort
from poolserve.service.inference.model import load_model
from poolserve.service.poolserver.load_request import parse_config
from poolserve.service.poolserver.metadata import model_config

from support import infer_request, write_model

# std::sort(idx, idx + n, [&](a, b) { return p[a] > p[b]; }) compiled with g++ 12
# (libstdc++), for 20 zeros and for 40 alternating 1, 0: Triton's tie order.
LIBSTDCXX_20_ZEROS = [10, 19, 18, 17, 16, 15, 14, 13, 12, 11, 0, 9, 8, 7, 6, 5, 4, 3, 2, 1]
LIBSTDCXX_40_ALTERNATING = [
    *[0, 26, 24, 28, 22, 20, 30, 18, 16, 32, 14, 12, 34, 10, 8, 36, 6, 4, 38, 2],
    *[33, 35, 31, 37, 29, 27, 39, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1],
]

CPP_SORT = r"""
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>
int main() {
  size_t n;
  while (scanf("%zu", &n) == 1) {
    std::vector<float> p(n);
    for (size_t i = 0; i < n; ++i) { char b[64]; scanf("%63s", b); p[i] = strtof(b, nullptr); }
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&p](size_t a, size_t b) { return p[a] > p[b]; });
    for (size_t i : idx) printf("%zu ", i);
    printf("\n");
  }
}
"""


def strings(array: np.ndarray) -> list[str]:
    return [item.decode() for item in array.ravel()]


def test_top_k_of_a_vector_is_score_index_label_highest_first() -> None:
    probs = np.array([0.1, 0.7, 0.05, 0.15], np.float32)
    out = top_classes("probs", probs, 3, [b"cat", b"dog", b"", b"fox"])
    assert out.shape == (3,)
    assert out.dtype == object
    # %f of the float32 widened to double, as std::to_string prints it
    assert strings(out) == ["0.700000:1:dog", "0.150000:3:fox", "0.100000:0:cat"]


def test_more_classes_than_elements_gives_every_element_and_a_shape_to_match() -> None:
    out = top_classes("probs", np.array([[2.0], [5.0]], np.float64), 10)
    assert out.shape == (2,)  # not batched: the whole tensor is one entry
    assert strings(out) == ["5.000000:1", "2.000000:0"]


def test_labels_beyond_the_file_and_empty_lines_give_the_index_alone() -> None:
    out = top_classes("p", np.arange(5, dtype=np.int32), 5, [b"zero", b"", b"two"])
    assert strings(out) == ["4:4", "3:3", "2:2:two", "1:1", "0:0:zero"]


def test_a_batched_model_classifies_each_entry_over_all_its_other_elements() -> None:
    probs = np.zeros((2, 2, 3), np.float32)
    probs[0, 1, 2] = 0.9  # entry 0: flat index 5
    probs[1, 0, 1] = 0.8  # entry 1: flat index 1
    out = top_classes("p", probs, 1, batched=True)
    assert out.shape == (2, 1)
    assert strings(out) == ["0.900000:5", "0.800000:1"]
    # The same tensor from a model without batching is one entry of 12.
    assert top_classes("p", probs, 2).shape == (2,)


def test_an_empty_batch_answers_an_empty_tensor() -> None:
    out = top_classes("p", np.zeros((0, 10), np.float32), 3, batched=True)
    assert out.shape == (0,)


def test_integer_scores_print_as_integers_and_nan_keeps_its_sign() -> None:
    assert strings(top_classes("p", np.array([7, 2**40], np.uint64), 1)) == [f"{2**40}:1"]
    nan = np.array([-np.nan], np.float32)
    assert strings(top_classes("p", nan, 1)) == ["-nan:0"]


@pytest.mark.parametrize(
    ("array", "datatype"),
    [
        (np.array([b"a"], dtype=object), "BYTES"),
        (np.array([True]), "BOOL"),
        (np.array([1.0], np.float16), "FP16"),  # Triton has no classification of FP16
    ],
)
def test_an_output_that_cannot_be_scored_is_invalid(array: np.ndarray, datatype: str) -> None:
    with pytest.raises(InvalidInput, match=f"output 'out'.*unsupported type '{datatype}'"):
        top_classes("out", array, 1)


def test_an_entry_larger_than_tritons_bound_is_invalid() -> None:
    with pytest.raises(InvalidInput, match="too large"):
        top_classes("p", np.zeros(1_000_001, np.uint8), 1)


def test_ties_come_out_in_libstdcxx_sort_order() -> None:
    assert triton_sort([0.0] * 20) == LIBSTDCXX_20_ZEROS
    assert triton_sort([1.0, 0.0] * 20) == LIBSTDCXX_40_ALTERNATING
    zeros = top_classes("p", np.zeros(20, np.float32), 3)
    assert strings(zeros) == ["0.000000:10", "0.000000:19", "0.000000:18"]


def test_without_ties_the_fast_path_and_the_replay_agree() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        row = rng.permutation(300).astype(np.float32)
        out = top_classes("p", row, 7)
        assert [int(s.split(":")[1]) for s in strings(out)] == triton_sort(row.tolist())[:7]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_replay_equals_a_compiled_std_sort_on_ties_nan_and_heap_sort_depths(
    tmp_path: Path,
) -> None:
    source = tmp_path / "sort.cc"
    source.write_text(CPP_SORT)
    binary = tmp_path / "sort"
    subprocess.run(["g++", "-O1", "-o", str(binary), str(source)], check=True, timeout=110)
    rand = random.Random(3)
    cases: list[list[float]] = []
    for n in (0, 1, 2, 3, 16, 17, 18, 33, 100, 1000, 3000):
        cases.append([0.0] * n)
        cases.append([float(rand.randint(0, 3)) for _ in range(n)])
        cases.append([rand.choice([0.0, 1.0, float("nan")]) for _ in range(n)])
        # an organ pipe exhausts the depth: std::sort ends in its heap sort
        cases.append([float(min(i, n - i)) for i in range(n)])
    text = "".join(f"{len(c)} " + " ".join(repr(x) for x in c) + "\n" for c in cases)
    run = subprocess.run([str(binary)], input=text, capture_output=True, text=True, timeout=60)
    expected = [[int(i) for i in line.split()] for line in run.stdout.splitlines()]
    assert len(expected) == len(cases)
    for case, want in zip(cases, expected, strict=True):
        assert triton_sort(case) == want, case[:20]


def request_with_classes(**params: pb.InferParameter) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    out = request.outputs.add(name="probs")
    for key, value in params.items():
        out.parameters[key].CopyFrom(value)
    return request


def test_the_classification_parameter_is_checked_before_predict() -> None:
    assert requested_classes(request_with_classes()) == {}
    ok = request_with_classes(classification=pb.InferParameter(int64_param=5))
    assert requested_classes(ok) == {"probs": 5}
    bad = [
        (request_with_classes(classification=pb.InferParameter(string_param="5")), "int64_param"),
        (request_with_classes(classification=pb.InferParameter(int64_param=0)), "expected > 0"),
        (
            request_with_classes(
                classification=pb.InferParameter(int64_param=1),
                shared_memory_region=pb.InferParameter(string_param="r"),
            ),
            "both 'shared_memory_region' and 'classification'",
        ),
    ]
    for request, message in bad:
        with pytest.raises(InvalidInput, match=message):
            requested_classes(request)


def test_label_files_read_as_triton_reads_them(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_bytes(b"a\n\nc\xff\n")
    (tmp_path / "no_newline.txt").write_bytes(b"x\ny")
    specs = [
        TensorSpec("p", "FP32", (3,), label_filename="labels.txt"),
        TensorSpec("q", "FP32", (3,), label_filename="no_newline.txt"),
        TensorSpec("r", "FP32", (3,)),
    ]
    assert read_labels(tmp_path, specs) == {"p": (b"a", b"", b"c\xff"), "q": (b"x", b"y")}
    with pytest.raises(LabelFileError, match=r"'gone\.txt' of output 'p' cannot be read"):
        read_labels(tmp_path, [TensorSpec("p", "FP32", (3,), label_filename="gone.txt")])
    with pytest.raises(LabelFileError, match="outside the model folder"):
        read_labels(tmp_path, [TensorSpec("p", "FP32", (3,), label_filename="../x.txt")])


CLASSIFIER = """
import numpy as np
from poolserve.service import Model

class Classifier(Model):
    def predict(self, inputs, parameters):
        return {"probs": np.array([[0.2, 0.5, 0.3]], np.float32), "name": np.array([b"x"], object)}
"""


def classifier(tmp_path: Path, labels: str | None = "labels.txt") -> Path:
    output: dict[str, object] = {"name": "probs", "datatype": "FP32", "shape": [1, 3]}
    if labels:
        output["parameters"] = {"label_filename": labels}
    return write_model(
        tmp_path,
        "classifier",
        {
            "name": "classifier",
            "implementation": "model.Classifier",
            "max_batch_size": 4,
            "inputs": [
                {
                    "name": "INPUT0",
                    "datatype": "FP32",
                    "shape": [-1, 3, 2, 2],
                    "parameters": {"format": "FORMAT_NCHW"},
                }
            ],
            "outputs": [output],
        },
        CLASSIFIER,
    )


def test_a_loaded_model_answers_classes_with_its_labels(tmp_path: Path) -> None:
    folder = classifier(tmp_path)
    (folder / "labels.txt").write_text("low\nhigh\n")  # fewer labels than classes
    model = load_model(parse_model_settings(folder / "model-settings.json"))
    image = np.zeros((1, 3, 2, 2), np.float32)  # the declared FP32 [-1,3,2,2]
    request = pb.ModelInferRequest.FromString(infer_request("classifier", image))
    request.outputs.add(name="probs").parameters["classification"].int64_param = 2
    reply, _ = infer(model, request.SerializeToString())
    response = pb.ModelInferResponse.FromString(reply)
    assert response.outputs[0].datatype == "BYTES"
    assert list(response.outputs[0].shape) == [1, 2]  # batched: [batch, k]
    assert strings(decode_outputs(response)["probs"]) == ["0.500000:1:high", "0.300000:2"]
    named = pb.ModelInferRequest.FromString(infer_request("classifier", image))
    named.outputs.add(name="name").parameters["classification"].int64_param = 1
    with pytest.raises(InvalidInput, match=r"output 'name'.*unsupported type 'BYTES'"):
        infer(model, named.SerializeToString())


def test_a_missing_label_file_fails_the_load_with_its_reason(tmp_path: Path) -> None:
    settings = parse_model_settings(classifier(tmp_path) / "model-settings.json")
    events: list[dict[str, object]] = []
    cargo = InferenceCargo([settings])
    cargo.load_initial(events.append)
    assert "classifier" not in cargo.models
    assert events[-1]["ok"] is False
    reason = str(events[-1]["reason"])
    assert "load failed: LabelFileError: label file 'labels.txt' of output 'probs'" in reason
    assert "cannot be read" in reason


def test_format_is_validated_at_parse_and_reported_in_model_config(tmp_path: Path) -> None:
    folder = classifier(tmp_path, labels="labels.txt")
    settings = parse_model_settings(folder / "model-settings.json")
    assert settings.inputs[0].format == "FORMAT_NCHW"
    config = model_config(
        "classifier", "", settings.max_batch_size, settings.inputs, settings.outputs
    ).config
    assert config.input[0].format == pb.ModelInput.FORMAT_NCHW
    assert list(config.input[0].dims) == [3, 2, 2]
    assert config.output[0].label_filename == "labels.txt"

    path = folder / "model-settings.json"
    data = json.loads(path.read_text())
    for change, message in [
        ({"format": "NCHW"}, "expected one of FORMAT_NONE, FORMAT_NHWC, FORMAT_NCHW"),
        ({"format": "FORMAT_NHWC", "shape": [-1, 4, 4]}, "needs 3 dimensions"),
    ]:
        broken = json.loads(json.dumps(data))
        broken["inputs"][0]["parameters"]["format"] = change["format"]
        broken["inputs"][0]["shape"] = change.get("shape", broken["inputs"][0]["shape"])
        path.write_text(json.dumps(broken))
        with pytest.raises(ConfigError, match=message):
            parse_model_settings(path)
    broken = json.loads(json.dumps(data))
    broken["outputs"][0]["parameters"]["format"] = "FORMAT_NCHW"
    path.write_text(json.dumps(broken))
    with pytest.raises(ConfigError, match="only inputs have a format"):
        parse_model_settings(path)


def test_a_config_override_may_repeat_format_and_labels_but_not_change_them(
    tmp_path: Path,
) -> None:
    settings = parse_model_settings(classifier(tmp_path) / "model-settings.json")
    specs = (settings.inputs, settings.outputs)
    same = {
        "input": [{"name": "INPUT0", "format": "FORMAT_NCHW", "dims": ["3", "2", "2"]}],
        "output": [{"name": "probs", "label_filename": "labels.txt"}],
    }
    parse_config("classifier", json.dumps(same)).apply(settings, specs)
    as_number = {"input": [{"name": "INPUT0", "format": pb.ModelInput.FORMAT_NCHW}]}
    parse_config("classifier", json.dumps(as_number)).apply(settings, specs)
    changed = {"input": [{"name": "INPUT0", "format": "FORMAT_NHWC"}]}
    with pytest.raises(InvalidInput, match=r"'input\[0\].format' is 'FORMAT_NHWC'"):
        parse_config("classifier", json.dumps(changed)).apply(settings, specs)
