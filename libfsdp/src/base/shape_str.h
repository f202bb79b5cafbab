// Shapes in error messages, one spelling for the whole library: "[2, 3]", as
// LibTorch prints an IntArrayRef (so a message matches what users see when
// they print the tensor's sizes()).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace fsdp {

inline std::string shape_str(c10::ArrayRef<int64_t> sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

}  // namespace fsdp
