#include "gpu_mlp.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>

#include <fmt/format.h>

namespace dsync::train {

// Linking libcublas would make every dsyncps process (CPU runs, scheduler, servers) pay for
// libcublasLt's load-time initialization: about 0.5 s and 200 MB resident each, measured on
// CUDA 13. So it is opened only when a GpuMlp is created.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasSgemv_v2) sgemv = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
};

namespace {

Result<CublasApi> OpenCublas() {
  // The soname of the toolkit compiled against (LD_LIBRARY_PATH, ld.so.cache), then that
  // toolkit's own copy.
  const std::string soname = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib ? "" : dlerror();
#ifdef DSYNC_CUBLAS_DIR
  if (!lib) {
    const std::string path = std::string(DSYNC_CUBLAS_DIR) + "/" + soname;
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
#endif
  if (!lib) {
    return Error(StatusCode::kUnavailable,
                 "GPU worker math: cannot load {} ({}); put the CUDA toolkit's library folder "
                 "on LD_LIBRARY_PATH or use --worker-math cpu",
                 soname, why);
  }
  // Never closed: the handles it creates live as long as the process may use them.
  CublasApi api;
  bool missing = false;
  std::string names;
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) {
      missing = true;
      names += names.empty() ? name : fmt::format(", {}", name);
    }
  };
  bind(api.create, "cublasCreate_v2");
  bind(api.destroy, "cublasDestroy_v2");
  bind(api.set_stream, "cublasSetStream_v2");
  bind(api.set_math_mode, "cublasSetMathMode");
  bind(api.sgemm, "cublasSgemm_v2");
  bind(api.sgemv, "cublasSgemv_v2");
  bind(api.status_string, "cublasGetStatusString");
  bind(api.status_name, "cublasGetStatusName");
  if (missing) {
    return Error(StatusCode::kUnavailable, "GPU worker math: {} lacks {}", soname, names);
  }
  return api;
}

Result<const CublasApi*> LoadCublas() {
  static const Result<CublasApi> api = OpenCublas();  // thread-safe, once per process
  if (!api.ok()) return api.status();
  return &*api;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Status CudaError(cudaError_t err, std::string_view what) {
  return Error(StatusCode::kUnavailable, "GPU worker math: {}: {} ({})", what,
               cudaGetErrorString(err), cudaGetErrorName(err));
}

Status CublasError(const CublasApi& api, cublasStatus_t st, std::string_view what) {
  return Error(StatusCode::kUnavailable, "GPU worker math: {}: {} ({})", what,
               api.status_string(st), api.status_name(st));
}

#define DSYNC_CUDA_RETURN(call, what)                     \
  do {                                                    \
    if (cudaError_t err_ = (call); err_ != cudaSuccess) { \
      return CudaError(err_, what);                       \
    }                                                     \
  } while (0)

#define DSYNC_CUBLAS_RETURN(call, what)                                \
  do {                                                                 \
    if (cublasStatus_t st_ = (call); st_ != CUBLAS_STATUS_SUCCESS) {   \
      return CublasError(*cublas_, st_, what);                         \
    }                                                                  \
  } while (0)

constexpr float kOne = 1.0f;
constexpr float kZero = 0.0f;

}  // namespace

template <typename T>
Status GpuMlp::Allocate(DeviceArray<T>& out, uint64_t n) {
  void* p = nullptr;
  DSYNC_CUDA_RETURN(cudaMalloc(&p, std::max<uint64_t>(n, 1) * sizeof(T)),
                    "allocating device memory");
  out.reset(static_cast<T*>(p));
  return Status::Ok();
}

Status GpuMlp::LoadLibraries() { return LoadCublas().status(); }

GpuMlp::GpuMlp(std::vector<uint32_t> sizes, uint32_t max_batch)
    : sizes_(std::move(sizes)), max_batch_(max_batch) {}

GpuMlp::~GpuMlp() {
  if (blas_) (void)cublas_->destroy(blas_);
  if (stream_) (void)cudaStreamDestroy(stream_);
}

Result<std::unique_ptr<GpuMlp>> GpuMlp::Create(std::vector<uint32_t> sizes, uint32_t max_batch) {
  if (sizes.size() < 2 || max_batch == 0) {
    return Error(StatusCode::kInvalidArgument, "GPU worker math: {} layer sizes, max batch {}",
                 sizes.size(), max_batch);
  }
  std::unique_ptr<GpuMlp> m(new GpuMlp(std::move(sizes), max_batch));
  DSYNC_RETURN_IF_ERROR(m->Init());
  return m;
}

Status GpuMlp::Init() {
  DSYNC_ASSIGN_OR_RETURN(cublas_, LoadCublas());
  DSYNC_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                    "creating a stream");
  DSYNC_CUBLAS_RETURN(cublas_->create(&blas_), "creating the cuBLAS handle");
  DSYNC_CUBLAS_RETURN(cublas_->set_stream(blas_, stream_), "setting the cuBLAS stream");
  // Plain FP32 GEMMs (no TF32 tensor-op shortcut): gradients match the CPU's to rounding.
  DSYNC_CUBLAS_RETURN(cublas_->set_math_mode(blas_, CUBLAS_DEFAULT_MATH), "setting the math mode");

  const size_t layers = sizes_.size() - 1;
  for (size_t l = 1; l <= layers; ++l) {
    offsets_.push_back(total_);
    total_ += uint64_t{sizes_[l]} * sizes_[l - 1];
    offsets_.push_back(total_);
    total_ += sizes_[l];
  }
  DSYNC_RETURN_IF_ERROR(Allocate(params_, total_));
  DSYNC_RETURN_IF_ERROR(Allocate(grads_, total_));
  DSYNC_RETURN_IF_ERROR(Allocate(x_, uint64_t{max_batch_} * sizes_[0]));
  DSYNC_RETURN_IF_ERROR(Allocate(labels_, max_batch_));
  act_.resize(layers + 1);
  dz_.resize(layers + 1);
  for (size_t l = 1; l <= layers; ++l) {
    DSYNC_RETURN_IF_ERROR(Allocate(act_[l], uint64_t{max_batch_} * sizes_[l]));
    DSYNC_RETURN_IF_ERROR(Allocate(dz_[l], uint64_t{max_batch_} * sizes_[l]));
  }
  DSYNC_RETURN_IF_ERROR(Allocate(ones_, max_batch_));
  DSYNC_RETURN_IF_ERROR(Allocate(row_loss_, max_batch_));
  DSYNC_RETURN_IF_ERROR(Allocate(row_correct_, max_batch_));
  const std::vector<float> ones(max_batch_, 1.0f);
  DSYNC_CUDA_RETURN(cudaMemcpyAsync(ones_.get(), ones.data(), ones.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_),
                    "filling the ones vector");
  DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "initializing");
  eval_x_.resize(size_t{max_batch_} * sizes_[0]);
  eval_labels_.resize(max_batch_);
  return Status::Ok();
}

Status GpuMlp::UploadParams(std::span<const float* const> params) {
  if (params.size() != offsets_.size()) {
    return Error(StatusCode::kInvalidArgument, "GPU worker math: {} tensors, the model has {}",
                 params.size(), offsets_.size());
  }
  for (size_t t = 0; t < params.size(); ++t) {
    const uint64_t end = t + 1 < offsets_.size() ? offsets_[t + 1] : total_;
    // From pageable memory the copy returns once the source has been read: the caller may
    // overwrite it (the next pull) as soon as this returns.
    DSYNC_CUDA_RETURN(cudaMemcpyAsync(params_.get() + offsets_[t], params[t],
                                      (end - offsets_[t]) * sizeof(float),
                                      cudaMemcpyHostToDevice, stream_),
                      "uploading the parameters");
  }
  return Status::Ok();
}

Status GpuMlp::UploadBatch(const float* x, const uint8_t* labels, uint32_t batch) {
  if (batch == 0 || batch > max_batch_) {
    return Error(StatusCode::kInvalidArgument, "GPU worker math: batch {} (the buffers hold {})",
                 batch, max_batch_);
  }
  DSYNC_CUDA_RETURN(cudaMemcpyAsync(x_.get(), x, size_t{batch} * sizes_[0] * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_),
                    "uploading the batch");
  DSYNC_CUDA_RETURN(cudaMemcpyAsync(labels_.get(), labels, batch, cudaMemcpyHostToDevice, stream_),
                    "uploading the labels");
  return Status::Ok();
}

// cuBLAS is column-major (cuBLAS docs, "Data Layout": https://docs.nvidia.com/cuda/cublas/
// #data-layout), and a row-major r x c matrix is the column-major c x r matrix, its transpose.
// So every row-major product C = A B below is computed as C^T = B^T A^T with the operands'
// roles swapped (cublas<t>gemm: C = alpha op(A) op(B) + beta C, m x n, inner dimension k).
Status GpuMlp::Forward(uint32_t batch) {
  const size_t layers = sizes_.size() - 1;
  const int b = static_cast<int>(batch);
  for (size_t l = 1; l <= layers; ++l) {
    const int n_in = static_cast<int>(sizes_[l - 1]);
    const int n_out = static_cast<int>(sizes_[l]);
    const float* in = l == 1 ? x_.get() : act_[l - 1].get();
    // out (batch x out) = in W^T  <=>  out^T (out x batch) = W in^T: the column-major view of
    // W (out x in, row-major) is W^T, hence op T; in^T is the column-major view of in.
    DSYNC_CUBLAS_RETURN(cublas_->sgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n_out, b, n_in, &kOne,
                                    weight(l), n_in, in, n_in, &kZero, act_[l].get(), n_out),
                        "forward GEMM");
    DSYNC_CUDA_RETURN(gpu::LaunchBiasActivation(act_[l].get(), bias(l), batch, sizes_[l],
                                                /*relu=*/l < layers, stream_),
                      "launching bias + ReLU");
  }
  return Status::Ok();
}

Status GpuMlp::RunGradient(std::span<const float* const> params, const float* x,
                           const uint8_t* labels, uint32_t batch, std::span<float* const> grads,
                           float* loss) {
  if (grads.size() != offsets_.size()) {
    return Error(StatusCode::kInvalidArgument, "GPU worker math: {} gradients, the model has {}",
                 grads.size(), offsets_.size());
  }
  DSYNC_RETURN_IF_ERROR(UploadBatch(x, labels, batch));
  DSYNC_RETURN_IF_ERROR(UploadParams(params));
  DSYNC_RETURN_IF_ERROR(Forward(batch));
  const size_t layers = sizes_.size() - 1;
  const int b = static_cast<int>(batch);
  // d loss / d logits = (softmax - onehot) / batch
  DSYNC_CUDA_RETURN(gpu::LaunchSoftmaxCrossEntropy(act_[layers].get(), labels_.get(), batch,
                                                   sizes_.back(),
                                                   1.0f / static_cast<float>(batch),
                                                   dz_[layers].get(), row_loss_.get(),
                                                   row_correct_.get(), stream_),
                    "launching softmax cross-entropy");
  for (size_t l = layers; l >= 1; --l) {
    const int n_in = static_cast<int>(sizes_[l - 1]);
    const int n_out = static_cast<int>(sizes_[l]);
    const float* in = l == 1 ? x_.get() : act_[l - 1].get();
    const float* dz = dz_[l].get();
    float* dw = grads_.get() + offsets_[2 * (l - 1)];
    float* db = grads_.get() + offsets_[2 * (l - 1) + 1];
    // dW (out x in) = dZ^T in  <=>  dW^T (in x out) = in^T dZ: in^T is in's column-major
    // view (op N), dZ is the transpose of dZ's column-major view (op T).
    DSYNC_CUBLAS_RETURN(cublas_->sgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, n_in, n_out, b, &kOne, in,
                                    n_in, dz, n_out, &kZero, dw, n_in),
                        "weight-gradient GEMM");
    // db = dZ^T 1: the column-major view of dZ is dZ^T (out x batch).
    DSYNC_CUBLAS_RETURN(cublas_->sgemv(blas_, CUBLAS_OP_N, n_out, b, &kOne, dz, n_out, ones_.get(),
                                    1, &kZero, db, 1),
                        "bias-gradient GEMV");
    if (l == 1) break;
    // dA(l-1) (batch x in) = dZ W  <=>  dA^T (in x batch) = W^T dZ^T: both are the operands'
    // column-major views (op N).
    DSYNC_CUBLAS_RETURN(cublas_->sgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, n_in, b, n_out, &kOne,
                                    weight(l), n_in, dz, n_out, &kZero, dz_[l - 1].get(), n_in),
                        "backward GEMM");
    DSYNC_CUDA_RETURN(gpu::LaunchReluBackward(dz_[l - 1].get(), act_[l - 1].get(),
                                              uint64_t{batch} * sizes_[l - 1], stream_),
                      "launching the ReLU derivative");
  }
  // The reductions wait for everything queued above; the downloads then find it done.
  double loss_sum = 0, squares = 0;
  uint32_t correct = 0;
  DSYNC_CUDA_RETURN(gpu::SumBatchMetrics(row_loss_.get(), row_correct_.get(), batch, scratch_,
                                         stream_, &loss_sum, &correct),
                    "reducing the batch's loss");
  DSYNC_CUDA_RETURN(gpu::SumOfSquares(grads_.get(), total_, scratch_, stream_, &squares),
                    "reducing the gradient's norm");
  for (size_t t = 0; t < grads.size(); ++t) {
    const uint64_t end = t + 1 < offsets_.size() ? offsets_[t + 1] : total_;
    DSYNC_CUDA_RETURN(cudaMemcpyAsync(grads[t], grads_.get() + offsets_[t],
                                      (end - offsets_[t]) * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_),
                      "downloading the gradients");
  }
  DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "computing the gradients");
  gradient_norm_ = std::sqrt(squares);
  *loss = static_cast<float>(loss_sum / batch);
  return Status::Ok();
}

float GpuMlp::Gradient(std::span<const float* const> params, const float* x,
                       const uint8_t* labels, uint32_t batch, std::span<float* const> grads) {
  float loss = kNaN;
  if (status_.ok()) status_ = RunGradient(params, x, labels, batch, grads, &loss);
  if (status_.ok()) return loss;
  // Whatever a failed call left in the outputs must not look like a gradient.
  gradient_norm_ = kNaN;
  for (size_t t = 0; t < grads.size() && t < offsets_.size(); ++t) {
    const uint64_t end = t + 1 < offsets_.size() ? offsets_[t + 1] : total_;
    std::fill(grads[t], grads[t] + (end - offsets_[t]), kNaN);
  }
  return kNaN;
}

Status GpuMlp::RunEvaluate(std::span<const float* const> params, const Dataset& data, uint32_t n,
                           Evaluation* e) {
  DSYNC_RETURN_IF_ERROR(UploadParams(params));
  if (n == 0) {
    // No batch below synchronizes: wait here, so the upload is done (and its errors
    // reported) on return, as when n > 0.
    DSYNC_CUDA_RETURN(cudaStreamSynchronize(stream_), "uploading the parameters");
  }
  std::vector<uint32_t> idx(max_batch_);
  uint64_t correct = 0;
  double loss = 0;
  for (uint32_t first = 0; first < n; first += max_batch_) {
    const uint32_t batch = std::min(max_batch_, n - first);
    std::iota(idx.begin(), idx.begin() + batch, first);
    Mlp::Gather(data, idx.data(), batch, eval_x_.data(), eval_labels_.data());
    DSYNC_RETURN_IF_ERROR(UploadBatch(eval_x_.data(), eval_labels_.data(), batch));
    DSYNC_RETURN_IF_ERROR(Forward(batch));
    DSYNC_CUDA_RETURN(gpu::LaunchSoftmaxCrossEntropy(act_.back().get(), labels_.get(), batch,
                                                     sizes_.back(), 0.0f, nullptr,
                                                     row_loss_.get(), row_correct_.get(),
                                                     stream_),
                      "launching softmax cross-entropy");
    // Synchronous: eval_x_ is refilled for the next batch only once this one is done.
    double batch_loss = 0;
    uint32_t batch_correct = 0;
    DSYNC_CUDA_RETURN(gpu::SumBatchMetrics(row_loss_.get(), row_correct_.get(), batch, scratch_,
                                           stream_, &batch_loss, &batch_correct),
                      "reducing the evaluation's loss");
    loss += batch_loss;
    correct += batch_correct;
  }
  e->samples = n;
  e->accuracy = n ? static_cast<double>(correct) / n : 0;
  e->loss = n ? loss / n : 0;
  return Status::Ok();
}

Evaluation GpuMlp::Evaluate(std::span<const float* const> params, const Dataset& data,
                            uint32_t limit) {
  const uint32_t n = limit == 0 ? data.count : std::min(limit, data.count);
  Evaluation e;
  if (status_.ok()) status_ = RunEvaluate(params, data, n, &e);
  if (status_.ok()) return e;
  e.samples = n;
  e.accuracy = e.loss = std::numeric_limits<double>::quiet_NaN();
  return e;
}

}  // namespace dsync::train
