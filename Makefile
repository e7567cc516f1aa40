# comet - build libcomet (static and shared), the `comet` tool and the tests.
#   make            build everything into build/
#   make test       build and run the C and Python tests (GPU and torch tests skip visibly)
#   make bench      build and run `comet bench` on every visible GPU
#   make PTXAS_V=1  print the kernels' register, shared memory and spill report
# NCCL >= 2.28 is found by scripts/find-nccl.sh ($NCCL_HOME, CUDA, system, Python package).

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc))
NVCC      := $(CUDA_HOME)/bin/nvcc
CC        ?= gcc
BUILD     := build
.DEFAULT_GOAL := all

# Where NCCL lives, found once per build directory (make clean to look again).
$(BUILD)/nccl.mk: scripts/find-nccl.sh
	@mkdir -p $(BUILD)
	@scripts/find-nccl.sh > $@.tmp && mv $@.tmp $@ || { rm -f $@.tmp; exit 1; }
include $(BUILD)/nccl.mk

ARCH      := -gencode=arch=compute_90a,code=sm_90a
INCLUDES  := -Iinclude -Isrc -I$(NCCL_INC) -I$(CUDA_HOME)/include
CFLAGS    := -std=c11 -O2 -g -Wall -Wextra -Werror=implicit-function-declaration -fPIC $(INCLUDES)
NVCCFLAGS := -std=c++17 -O3 -g $(ARCH) -Xcompiler -fPIC,-Wall $(INCLUDES) $(if $(PTXAS_V),-Xptxas -v)
LDLIBS    := -L$(CUDA_HOME)/lib64 -lcublas -lcudart -L$(NCCL_LIB) -l:libnccl.so.2 \
             -Wl,-rpath,$(NCCL_LIB) -Wl,-rpath,$(CUDA_HOME)/lib64 -lstdc++ -lm -lpthread -ldl -lrt

LIB_C   := src/status.c src/config.c src/route_plan.c src/routing_gen.c src/reference.c src/comm.c src/moe.c src/layer0.c src/layer1.c src/timeline.c src/tune.c src/launch.c \
           src/baseline/baseline.c
LIB_CU  := src/kernels/symmetric.cu src/kernels/route.cu src/kernels/baseline.cu src/kernels/fill.cu \
           src/kernels/gemm.cu src/kernels/combine.cu
LIB_OBJ := $(LIB_C:%.c=$(BUILD)/%.o) $(LIB_CU:%.cu=$(BUILD)/%.o)
TOOL_OBJ := $(BUILD)/tools/comet.o $(BUILD)/tools/bench.o $(BUILD)/tools/gemm.o
TEST_OBJ := $(BUILD)/tests/runner.o $(BUILD)/tests/test_cpu.o $(BUILD)/tests/test_gpu.o
HEADERS := $(wildcard include/*.h src/*.h src/*/*.h src/kernels/*.cuh tests/*.h tools/*.h)

all: $(BUILD)/libcomet.a $(BUILD)/libcomet.so $(BUILD)/comet $(BUILD)/comet_tests

$(BUILD)/%.o: %.c $(HEADERS) $(BUILD)/nccl.mk
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cu $(HEADERS) $(BUILD)/nccl.mk
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/libcomet.a: $(LIB_OBJ)
	ar rcs $@ $^

$(BUILD)/libcomet.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

$(BUILD)/comet: $(TOOL_OBJ) $(BUILD)/libcomet.a
	$(CC) -o $@ $(TOOL_OBJ) $(BUILD)/libcomet.a $(LDLIBS)

$(BUILD)/comet_tests: $(TEST_OBJ) $(BUILD)/libcomet.a
	$(CC) -o $@ $(TEST_OBJ) $(BUILD)/libcomet.a $(LDLIBS)

# The C tests, then the Python package's CPU tests; one closing line sums both.
test: $(BUILD)/comet_tests $(BUILD)/libcomet.so
	scripts/run-tests.sh

bench: $(BUILD)/comet
	$(BUILD)/comet bench

clean:
	rm -rf $(BUILD)

.PHONY: all test bench clean
