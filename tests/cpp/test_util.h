#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>

#include <torchleaf/torchleaf.h>

// Every test defines its leaves under a unique name: names are process-wide.
inline std::string unique_name(const std::string& base) {
  static std::atomic<int> counter{0};
  return "cpptest::" + base + std::to_string(counter++);
}

#define EXPECT_THROW_WITH(stmt, substring)                                  \
  do {                                                                      \
    try {                                                                   \
      stmt;                                                                 \
      ADD_FAILURE() << "expected an exception containing: " << (substring); \
    } catch (const c10::Error& e) {                                         \
      EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)   \
          << "message was: " << e.what();                                   \
    }                                                                       \
  } while (0)
