// See slab.h.
#include "slab.h"

namespace oxygen {

std::size_t class_size(int cls) {
  if (cls < 8) return static_cast<std::size_t>(cls + 1) * kMinBlock;
  int k = 12 + (cls - 8) / 4;
  std::size_t base = std::size_t{1} << k;
  return base + static_cast<std::size_t>((cls - 8) % 4 + 1) * (base / 4);
}

int size_class(std::size_t bytes) {
  if (bytes > kMaxSlabBlock) return -1;
  if (bytes <= 4096) return static_cast<int>((bytes + kMinBlock - 1) / kMinBlock) - 1;
  int k = 12;  // 2^k < bytes <= 2^(k+1)
  while ((std::size_t{1} << (k + 1)) < bytes) ++k;
  std::size_t base = std::size_t{1} << k, step = base / 4;
  int idx = static_cast<int>((bytes - base + step - 1) / step);  // 1..4
  return 8 + (k - 12) * 4 + idx - 1;
}

}  // namespace oxygen
