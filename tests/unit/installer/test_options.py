from installer.options import flags


def test_with_flags():
    assert flags("with", {"ze": "yes", "java": False, "cuda": "/usr/local/cuda", "x": True}) == [
        "--with-ze=yes", "--without-java", "--with-cuda=/usr/local/cuda", "--with-x"]


def test_enable_flags():
    assert flags("enable", {"mt": True, "debug": False}) == ["--enable-mt", "--disable-debug"]


def test_meson_flags():
    assert flags("meson", {"build_tests": False, "enable_plugins": "UCX", "x": True}) == [
        "-Dbuild_tests=false", "-Denable_plugins=UCX", "-Dx=true"]


def test_cmake_flags():
    assert flags("cmake", {"BUILD_TESTING": False, "PIC": True, "STD": "17"}) == [
        "-DBUILD_TESTING=OFF", "-DPIC=ON", "-DSTD=17"]
