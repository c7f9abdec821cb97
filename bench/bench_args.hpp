#pragma once
// Flag parsing shared by the benchmark programs: `--name value` pairs bound to variables.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

/// The median of timings (the mean of the two middle ones for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

/// Binds each flag to a setter; `parse` applies `--flag value` pairs and rejects anything else with the list.
class Flags {
 public:
  Flags& add(const std::string& name, int& v) {
    return bind(name, [&v](const std::string& s) { v = std::stoi(s); });
  }
  Flags& add(const std::string& name, std::int64_t& v) {
    return bind(name, [&v](const std::string& s) { v = std::stoll(s); });
  }
  Flags& add(const std::string& name, std::size_t& v) {
    return bind(name, [&v](const std::string& s) { v = std::stoul(s); });
  }
  Flags& add(const std::string& name, double& v) {
    return bind(name, [&v](const std::string& s) { v = std::stod(s); });
  }
  Flags& add(const std::string& name, std::string& v) {
    return bind(name, [&v](const std::string& s) { v = s; });
  }
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; i += 2) {
      auto it = setters_.find(argv[i]);
      if (it == setters_.end() || i + 1 >= argc) {
        std::string usage;
        for (const auto& [name, f] : setters_)
          usage += " " + name + " N";
        throw std::invalid_argument(
            std::string(it == setters_.end() ? "unknown argument " : "missing value for ") + argv[i] +
            "; use" + usage);
      }
      try {
        it->second(argv[i + 1]);
      } catch (const std::out_of_range&) {  // from std::stoi and friends
        throw std::invalid_argument(std::string(argv[i]) + ": " + argv[i + 1] + " is out of range");
      } catch (const std::invalid_argument&) {
        throw std::invalid_argument(std::string(argv[i]) + ": expected a number, got '" + argv[i + 1] + "'");
      }
    }
  }

 private:
  Flags& bind(const std::string& name, std::function<void(const std::string&)> f) {
    setters_[name] = std::move(f);
    return *this;
  }
  std::map<std::string, std::function<void(const std::string&)>> setters_;
};

}  // namespace bench
