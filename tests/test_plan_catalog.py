"""The planner's GPU and interconnect database: the built-in figures hold together,
names resolve however they are spelled, and users' files correct and extend it or are
refused with the file, line and column at fault."""

import os

import pytest

from hetcomm.plan.catalog import DEVICE_COLUMNS, LINK_COLUMNS, UnknownName, load_catalog, normalise

DEVICE_HEADER = ",".join(DEVICE_COLUMNS)
LINK_HEADER = ",".join(LINK_COLUMNS)


def write(tmp_path, name, *lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_builtin_devices_hold_together(catalog):
    assert len(catalog.devices) >= 40
    for device in catalog.devices.values():
        assert device.source == "built-in"
        assert device.memory_gib > 0 and device.bandwidth_gbs > 0 and device.fp32_tflops > 0, device.name
        assert device.architecture in ("Pascal", "Volta", "Turing", "Ampere", "Ada", "Hopper"), device.name
        # Native bf16 came with sm_80, tensor cores with Volta (no GTX 16-series in the table).
        assert (device.bf16_tflops is not None) == (device.capability >= (8, 0)), device.name
        assert device.tensor_cores == (device.capability >= (7, 0)), device.name
        if device.capability == (6, 1):  # GP102/GP104/GP106: fp16 at 1/64 of the fp32 rate
            assert device.fp16_tflops == pytest.approx(device.fp32_tflops / 64, rel=0.01), device.name
        else:
            assert device.fp16_tflops > device.fp32_tflops, device.name
        if device.bf16_tflops is not None:
            assert device.bf16_tflops == device.fp16_tflops, device.name


def test_builtin_reference_figures(catalog):
    def figures(name):
        d = catalog.devices[name]
        return d.capability, d.fp32_tflops, d.fp16_tflops, d.bf16_tflops, d.memory_gib, d.bandwidth_gbs

    assert figures("1080ti") == ((6, 1), 11.34, 0.177, None, 11, 484)
    assert figures("p100-pcie-16gb") == ((6, 0), 9.3, 18.7, None, 16, 732)
    assert figures("v100") == ((7, 0), 15.7, 125, None, 16, 900)
    assert figures("v100-pcie-16gb") == ((7, 0), 14, 112, None, 16, 900)
    assert figures("t4") == ((7, 5), 8.1, 65, None, 16, 320)
    assert figures("2080ti") == ((7, 5), 13.45, 53.8, None, 11, 616)
    assert figures("3090") == ((8, 6), 35.58, 71, 71, 24, 936)
    assert figures("a100") == ((8, 0), 19.5, 312, 312, 40, 1555)
    assert catalog.devices["a100-80gb"].bandwidth_gbs == 2039


def test_builtin_links(catalog):
    assert {"pcie3", "nvlink2", "10gbe", "ib-edr", "ib-ndr"} <= set(list(catalog.links))
    for link in catalog.links.values():
        assert link.scope in ("node", "network") and link.bandwidth_gbs > 0 and link.latency_us > 0, link.name
    assert catalog.link("10GbE").bandwidth_gbs == pytest.approx(1.17)
    # Faster generations are faster.
    for kind in (["pcie3", "pcie4", "pcie5"], ["nvlink1", "nvlink2", "nvlink3", "nvlink4"],
                 ["1gbe", "10gbe", "25gbe", "40gbe", "100gbe"], ["ib-qdr", "ib-fdr", "ib-edr", "ib-hdr", "ib-ndr"]):
        speeds = [catalog.links[name].bandwidth_gbs for name in kind]
        assert speeds == sorted(speeds), kind


def test_peak_tflops(catalog):
    assert catalog.device("3090").peak_tflops("bf16") == 71
    assert catalog.device("3090").peak_tflops("fp16") == 71
    assert catalog.device("1080ti").peak_tflops("fp32") == 11.34
    with pytest.raises(ValueError, match=r"v100 \(Tesla V100 SXM2 16GB\) has no native bf16"):
        catalog.device("v100").peak_tflops("bf16")
    with pytest.raises(ValueError, match="expected one of fp32, fp16, bf16"):
        catalog.device("v100").peak_tflops("fp8")


def test_normalise():
    assert normalise("NVIDIA GeForce RTX 2080 Ti") == "rtx2080ti"
    assert normalise("nvidia-tesla-v100") == "v100"
    assert normalise("Quadro_RTX 6000") == "rtx6000"
    assert normalise("TITAN X (Pascal)") == "titanxpascal"
    # Only whole words are brand words.
    assert normalise("TeslaV100") == "teslav100"


@pytest.mark.parametrize("text, name", [
    ("GTX 1080 Ti", "1080ti"), ("1080ti", "1080ti"), ("GeForce GTX 1080 Ti", "1080ti"), ("1080 TI", "1080ti"),
    ("nvidia-tesla-v100", "v100"), ("Tesla V100-SXM2-16GB", "v100"), ("Tesla V100-SXM2-32GB", "v100-32gb"),
    ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"), ("V100 PCIe", "v100-pcie-16gb"),
    ("Tesla T4", "t4"), ("t4", "t4"), ("rtx2080ti", "2080ti"), ("NVIDIA GeForce RTX 3090", "3090"),
    ("RTX 3060", "3060"), ("TITAN X (Pascal)", "titanx"), ("NVIDIA TITAN Xp", "titanxp"),
    ("Tesla P100-PCIE-12GB", "p100-pcie-12gb"), ("P100", "p100"), ("Quadro RTX 8000", "rtx8000"),
    ("A100", "a100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA RTX A6000", "a6000"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA L40S", "l40s"), ("H200", "h200"),
])
def test_device_spellings(catalog, text, name):
    assert catalog.device(text).name == name


@pytest.mark.parametrize("text, name", [
    ("PCIe 3.0 x16", "pcie3"), ("pcie gen4", "pcie4"), ("NVLink", None), ("nvlink v100", "nvlink2"),
    ("10 Gigabit Ethernet", "10gbe"), ("10GbE", "10gbe"), ("InfiniBand EDR", "ib-edr"), ("ib_hdr", "ib-hdr"),
    ("NDR", "ib-ndr"),
])
def test_link_spellings(catalog, text, name):
    if name is None:
        with pytest.raises(UnknownName):
            catalog.link(text)
    else:
        assert catalog.link(text).name == name


def test_unknown_device_suggests_nearest(catalog):
    with pytest.raises(UnknownName) as caught:
        catalog.device("1080tii")
    assert str(caught.value) == ("unknown GPU '1080tii'; nearest known: 1080ti (GeForce GTX 1080 Ti), "
                                 "2080ti (GeForce RTX 2080 Ti), 1080 (GeForce GTX 1080)")
    with pytest.raises(UnknownName, match=r"nearest known: v100 \(Tesla V100 SXM2 16GB\)"):
        catalog.device("Tesla V1000")
    # Nothing close: the whole list, so the user sees what there is.
    with pytest.raises(UnknownName, match=r"unknown GPU 'zzz'; known: 1060, 1070, .*, h200$"):
        catalog.device("zzz")
    assert issubclass(UnknownName, ValueError)


def test_unknown_link_suggests_nearest(catalog):
    with pytest.raises(UnknownName, match=r"unknown interconnect 'nvlink5'; nearest known: nvlink4 \(NVLink 4\.0"):
        catalog.link("nvlink5")
    with pytest.raises(UnknownName, match=r"unknown interconnect 'abcGB/s'; .*or give a bandwidth"):
        catalog.link("abcGB/s")


@pytest.mark.parametrize("text, bandwidth, latency", [
    ("10gbit", 1.25, 30), ("10Gbit/s", 1.25, 30), ("100 Gbps", 12.5, 30), ("2.5GB/s@40us", 2.5, 40),
    (" 25 Gbit/s @ 5 us ", 3.125, 5), (".5GB/s", 0.5, 30),
])
def test_custom_link(catalog, text, bandwidth, latency):
    link = catalog.link(text)
    assert (link.name, link.scope, link.source, link.aliases) == (text, "custom", "custom", ())
    assert link.bandwidth_gbs == pytest.approx(bandwidth) and link.latency_us == latency


@pytest.mark.parametrize("text, message", [
    ("3gb/s", "'gb/s' could mean gigabits or gigabytes; write Gbit/s or GB/s"),
    ("3Gb/s", "could mean gigabits or gigabytes"),
    ("0GB/s", "must be positive"), ("-1gbit", "must be positive"), ("1gbit@0us", "must be positive"),
])
def test_bad_custom_link(catalog, text, message):
    with pytest.raises(ValueError, match=message) as caught:
        catalog.link(text)
    assert not isinstance(caught.value, UnknownName)


def test_user_file_overrides_and_adds(tmp_path):
    devices = write(tmp_path, "mine.csv",
                    "# my cluster's cards",
                    DEVICE_HEADER,
                    "1080ti,GeForce GTX 1080 Ti,,Pascal,6.1,12.5,0.195,,no,11,484",
                    "",
                    "mycard,Example Card 9000,ex9000;my card,Ampere,8.6,20,80,80,yes,16,500")
    links = write(tmp_path, "links.csv", LINK_HEADER, "slowlan,Office LAN,,network,0.05,200")
    catalog = load_catalog([devices, str(links)])
    assert catalog.device("GTX 1080 Ti").fp32_tflops == 12.5
    assert catalog.device("1080ti").source == str(devices)
    assert catalog.device("2080ti").source == "built-in"
    card = catalog.device("My Card")
    assert (card.name, card.aliases, card.capability, card.bf16_tflops, card.tensor_cores) == \
        ("mycard", ("ex9000", "my card"), (8, 6), 80, True)
    # A replaced row keeps its place; a new one comes last.
    names = list(catalog.devices)
    assert names.index("1080ti") == list(load_catalog().devices).index("1080ti") and names[-1] == "mycard"
    assert catalog.link("office lan").bandwidth_gbs == 0.05 and list(catalog.links)[-1] == "slowlan"


def test_later_file_wins(tmp_path, monkeypatch):
    first = write(tmp_path, "first.csv", DEVICE_HEADER, "t4,Tesla T4,,Turing,7.5,8.1,60,,yes,16,320")
    second = write(tmp_path, "second.csv", DEVICE_HEADER, "t4,Tesla T4,,Turing,7.5,8.1,50,,yes,16,320")
    monkeypatch.setenv("HETCOMM_DEVICES", str(first))
    assert load_catalog().device("t4").fp16_tflops == 60
    assert load_catalog([second]).device("t4").fp16_tflops == 50  # extra files come after the variable


def test_files_from_environment(tmp_path, monkeypatch):
    one = write(tmp_path, "one.csv", DEVICE_HEADER, "card-one,Card One,,Pascal,6.1,6.4,0.1,,no,8,256")
    two = write(tmp_path, "two.csv", LINK_HEADER, "pcie3,PCIe 3.0 x16,,node,10,6")
    monkeypatch.setenv("HETCOMM_DEVICES", os.pathsep.join([str(one), str(two), ""]))  # an empty entry is skipped
    catalog = load_catalog()
    assert catalog.device("card one").source == str(one)
    assert (catalog.link("pcie3").bandwidth_gbs, catalog.link("pcie3").source) == (10, str(two))


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="device file .*nope.csv' does not exist"):
        load_catalog([tmp_path / "nope.csv"])
    monkeypatch.setenv("HETCOMM_DEVICES", str(tmp_path / "gone.csv"))
    with pytest.raises(FileNotFoundError, match="file named in HETCOMM_DEVICES .*gone.csv' does not exist"):
        load_catalog()


GOOD = ["x1", "X One", "", "Pascal", "6.1", "6.4", "0.1", "", "no", "8", "256"]


@pytest.mark.parametrize("column, value, expected", [
    ("fp32_tflops", "abc", "a positive number"), ("fp16_tflops", "0", "a positive number"),
    ("memory_gib", "-8", "a positive number"), ("bandwidth_gbs", "nan", "a positive number"),
    ("bf16_tflops", "fast", "a positive number"), ("capability", "6", "major.minor, like 6.1"),
    ("tensor_cores", "maybe", "yes or no"), ("label", "", "a non-empty text"), ("architecture", "", "a non-empty text"),
    ("name", "X 1", "lowercase letters, digits and '-', not only a brand word"),
    ("name", "", "lowercase letters, digits and '-', not only a brand word"),
    ("aliases", "ok;nvidia", "names separated by ';', each with more than brand words and punctuation"),
])
def test_malformed_device_row(tmp_path, column, value, expected):
    row = dict(zip(DEVICE_COLUMNS, GOOD), **{column: value})
    path = write(tmp_path, "bad.csv", "# comment", DEVICE_HEADER, ",".join(row.values()))
    with pytest.raises(ValueError) as caught:
        load_catalog([path])
    assert str(caught.value) == f"{path}:3: column {column!r} = {value!r}: expected {expected}"


@pytest.mark.parametrize("row, message", [
    ("lan,LAN,,office,1,50", "column 'scope' = 'office': expected node or network"),
    ("lan,LAN,,network,1,soon", "column 'latency_us' = 'soon': expected a positive number"),
    ("lan,LAN,,network,1", "missing column(s) 'latency_us'"),
    ("lan,LAN,,network", "missing column(s) 'bandwidth_gbs', 'latency_us'"),
    ("lan,LAN,,network,1,50,7", "1 extra column(s) after 'latency_us'"),
])
def test_malformed_link_row(tmp_path, row, message):
    path = write(tmp_path, "bad.csv", LINK_HEADER, row)
    with pytest.raises(ValueError) as caught:
        load_catalog([path])
    assert str(caught.value) == f"{path}:2: {message}"


def test_unknown_or_missing_header(tmp_path):
    path = write(tmp_path, "bad.csv", "# devices", "name,label,fp32", "x,X,1")
    with pytest.raises(ValueError) as caught:
        load_catalog([path])
    message = str(caught.value)
    assert message.startswith(f"{path}:2: unknown header name,label,fp32;")
    assert DEVICE_HEADER in message and LINK_HEADER in message
    empty = write(tmp_path, "empty.csv", "# nothing yet")
    with pytest.raises(ValueError, match="empty.csv: no header row"):
        load_catalog([empty])


def test_same_name_twice_in_one_file(tmp_path):
    row = ",".join(GOOD)
    path = write(tmp_path, "twice.csv", DEVICE_HEADER, row, row)
    with pytest.raises(ValueError, match=r"twice.csv:3: 'x1' is already defined on line 2"):
        load_catalog([path])


def test_ambiguous_alias(tmp_path):
    # "GTX-1080-Ti" normalises to the built-in 1080 Ti's label.
    path = write(tmp_path, "clash.csv", DEVICE_HEADER,
                 "fast,Fast Card,GTX-1080-Ti,Pascal,6.1,6.4,0.1,,no,8,256")
    with pytest.raises(ValueError) as caught:
        load_catalog([path])
    assert str(caught.value) == (f"GPU '1080ti' (built-in) and GPU 'fast' ({path}) both answer to 'GTX-1080-Ti'; "
                                 f"rename one, or remove the alias")
    # Two rows of one user file.
    path = write(tmp_path, "clash2.csv", DEVICE_HEADER,
                 "one,Card One,shared,Pascal,6.1,6.4,0.1,,no,8,256",
                 "two,Card Two,Shared!,Pascal,6.1,6.4,0.1,,no,8,256")
    with pytest.raises(ValueError, match=r"GPU 'one' \(.*clash2.csv\) and GPU 'two' \(.*clash2.csv\) both answer"):
        load_catalog([path])


def test_user_file_saved_by_a_spreadsheet(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(("\ufeff" + LINK_HEADER + "\r\nlan,Office LAN,,network,0.05,200\r\n").encode())
    assert load_catalog([path]).link("lan").latency_us == 200
