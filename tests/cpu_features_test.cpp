#include "support.hpp"

#include <memattn/cpu_features.hpp>
#include <memattn/detail/isa_regions.hpp>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

TEST_CASE("cpu_features: CPUID's features are the kernel's /proc/cpuinfo flags, and what this binary was compiled "
          "for runs here",
          "[cpu_features]") {
    const memattn::CpuFeatures& f = memattn::cpu_features();
    CHECK(&f == &memattn::cpu_features());  // found once
    const memattn::CompiledPaths compiled = memattn::compiled_paths();
    if (compiled.avx2)  // this binary runs here, so the CPU has what it was compiled for
        CHECK(f.avx2_usable());
    if (compiled.avx512)
        CHECK(f.avx512_usable());
    if (compiled.avx512_bf16)
        CHECK(f.avx512_bf16_usable());
    CHECK_FALSE((compiled.avx512_bf16 && compiled.avx512_bf16_by_target));  // by target only where not in place
    // The bfloat16 kernel's arithmetic: on bfloat16 pairs wherever the CPU has AVX512-BF16
    // and GCC or Clang built this for x86-64, whatever its -march; what the kernel takes.
    const memattn::Bf16Products products = memattn::bf16_products();
    INFO("bf16_products " << static_cast<int>(products));
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MEMATTN_NO_DISPATCH)
    CHECK((products != memattn::Bf16Products::converted_float) == f.avx512_bf16_usable());
#endif
    CHECK((products != memattn::Bf16Products::converted_float) == memattn::detail::avx512_bf16_runs());
    CHECK((products == memattn::Bf16Products::amx_tiles) == (f.amx_usable() && memattn::request_amx()));
    const std::string text = memattn::describe(f);
    CHECK(text.find("(os: ") != std::string::npos);
    CHECK((text.find("avx2") != std::string::npos) == f.avx2);

    std::ifstream cpuinfo("/proc/cpuinfo");
    std::set<std::string> flags;
    for (std::string line; std::getline(cpuinfo, line);)
        if (line.rfind("flags", 0) == 0) {
            std::istringstream words(line.substr(line.find(':') + 1));
            for (std::string w; words >> w;)
                flags.insert(w);
            break;
        }
    if (flags.empty()) {
        WARN("no /proc/cpuinfo flags here: the features are not cross-checked");
        return;
    }
    const auto listed = [&](const char* name) { return flags.count(name) > 0; };
    INFO(text);
    CHECK(f.avx2 == listed("avx2"));
    CHECK(f.fma == listed("fma"));
    CHECK(f.f16c == listed("f16c"));
    CHECK(f.avx512f == listed("avx512f"));
    CHECK(f.avx512bw == listed("avx512bw"));
    CHECK(f.avx512dq == listed("avx512dq"));
    CHECK(f.avx512vl == listed("avx512vl"));
    CHECK(f.avx512_bf16 == listed("avx512_bf16"));
    CHECK(f.avx512_fp16 == listed("avx512_fp16"));
    CHECK(f.avx512_vnni == listed("avx512_vnni"));
    CHECK(f.avx_vnni == listed("avx_vnni"));
    CHECK(f.amx_tile == listed("amx_tile"));
    CHECK(f.amx_bf16 == listed("amx_bf16"));
    CHECK(f.amx_int8 == listed("amx_int8"));
    // Linux lists a feature only where it saves its registers, and grants the tiles it lists.
    if (listed("avx"))
        CHECK(f.os_avx);
    if (listed("avx512f"))
        CHECK(f.os_avx512);
    if (listed("amx_tile")) {
        CHECK(f.os_amx);
        CHECK(f.amx_usable() == (f.amx_bf16 && f.avx512_usable() && f.amx_allowed));
        if (f.amx_usable())
            CHECK(memattn::request_amx());  // Linux grants what it lists (no seccomp filter here)
    } else {
        CHECK_FALSE(f.amx_usable());
        CHECK_FALSE(memattn::request_amx());
    }
}
