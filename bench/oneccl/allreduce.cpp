// One rank of a oneCCL allreduce sweep, for bench/bench_oneccl.py (oneCCL ships no benchmark of its own).
//
// Usage: allreduce RANK SIZE ADDRESS_FILE ITERS WARMUP LOAD BYTES...
// Rank 0 creates oneCCL's key-value store and writes its address to ADDRESS_FILE
// (written to a temporary name, then renamed); the others wait for the file and
// join. For each size: WARMUP calls, a barrier, ITERS timed in-place float32 SUM
// allreduces; the slowest rank's mean (an allreduce of MAX) is what rank 0 prints,
// one "bytes microseconds wrong" line per size, wrong = elements that differ from
// the expected sum. LOAD compute threads (256x256 float32 matrix products in
// plain C++) run beside the sweep, as ferro bench --load's do in every rank.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "oneapi/ccl.hpp"

namespace {

std::atomic<bool> stop_load{false};

void compute_load() {
    const int n = 256;
    std::vector<float> a(n * n, 1.0f / n), c(n * n);
    while (!stop_load.load(std::memory_order_relaxed)) {
        for (int i = 0; i < n; ++i)
            for (int k = 0; k < n; ++k) {
                const float aik = a[i * n + k];
                for (int j = 0; j < n; ++j)
                    c[i * n + j] += aik * a[k * n + j];
            }
    }
}

double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 8) {
        std::cerr << "usage: allreduce RANK SIZE ADDRESS_FILE ITERS WARMUP LOAD BYTES...\n";
        return 2;
    }
    const int rank = std::atoi(argv[1]), size = std::atoi(argv[2]);
    const std::string address_file = argv[3];
    const int iters = std::atoi(argv[4]), warmup = std::atoi(argv[5]), load = std::atoi(argv[6]);

    ccl::init();
    ccl::shared_ptr_class<ccl::kvs> kvs;
    ccl::kvs::address_type address;
    if (rank == 0) {
        kvs = ccl::create_main_kvs();
        address = kvs->get_address();
        const std::string partial = address_file + ".partial";
        std::ofstream(partial, std::ios::binary).write(address.data(), address.size());
        std::rename(partial.c_str(), address_file.c_str());
    }
    else {
        const double give_up = now_us() + 60e6;
        std::ifstream in;
        while (!(in = std::ifstream(address_file, std::ios::binary)).good()) {
            if (now_us() > give_up) {
                std::cerr << "rank " << rank << ": no key-value store address in " << address_file << " after 60 s\n";
                return 1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        in.read(address.data(), address.size());
        kvs = ccl::create_kvs(address);
    }
    auto comm = ccl::create_communicator(size, rank, kvs);

    std::vector<std::thread> threads;
    for (int i = 0; i < load; ++i)
        threads.emplace_back(compute_load);

    const float expected = size * (size + 1) / 2.0f;
    for (int arg = 7; arg < argc; ++arg) {
        const size_t bytes = std::strtoull(argv[arg], nullptr, 10);
        const size_t count = bytes / sizeof(float) ? bytes / sizeof(float) : 1;
        std::vector<float> buf(count);
        const int scaled = bytes > 4000000 ? std::max(1, static_cast<int>(iters * 4e6 / bytes)) : iters;
        for (int i = 0; i < warmup; ++i)
            ccl::allreduce(buf.data(), buf.data(), count, ccl::reduction::sum, comm).wait();
        ccl::barrier(comm);
        const double start = now_us();
        for (int i = 0; i < scaled; ++i)
            ccl::allreduce(buf.data(), buf.data(), count, ccl::reduction::sum, comm).wait();
        double mean = (now_us() - start) / scaled;
        ccl::allreduce(&mean, &mean, 1, ccl::reduction::max, comm).wait();
        std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
        ccl::allreduce(buf.data(), buf.data(), count, ccl::reduction::sum, comm).wait();
        size_t wrong = 0;
        for (float value : buf)
            wrong += value != expected;
        if (rank == 0)
            std::printf("%zu %.3f %zu\n", count * sizeof(float), mean, wrong);
        std::fflush(stdout);
    }
    stop_load = true;
    for (auto& thread : threads)
        thread.join();
    return 0;
}
